"""Throughput of `dspark prepare-data` on the default target: backends (engine, batched `generate()`) × kernels.

Every variant `BACKEND@KERNELS` answers the same training prompts (`dspark_hf.evaluation.prompt_sets.training_prompts`:
chat, code and math) through `dspark_hf.train.prepare_data` itself, so the figure includes tokenization, the
chat template and the JSONL writing. Runs are interleaved (each variant in turn, every repeat) in one process
and the medians over repeats are reported as generated tokens per second (each response through its
end-of-turn token), with each variant's median per-repeat ratio to the first.

Greedy runs also compare the responses with one-at-a-time greedy decoding on the same kernels (`generate()`
on each prompt alone, batch 1), token for token: on stock or packed kernels batched decoding is not
guaranteed to be bit-identical to it (those kernels are not batch-invariant, so a near-tie can flip a token);
on the exact kernels it is, by construction.

Usage:
    python benchmarks/bench_prepare_data.py [--prompts 16] [--max-new-tokens 64] [--batch-size 16] \
        [--repeats 3] [--modes sample,greedy] [--variants engine@exact,engine@stock,generate@stock] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf.default_model import load_default_target
from dspark_hf.evaluation.prompt_sets import training_prompts
from dspark_hf.train import PrepareDataArguments
from dspark_hf.train import data as data_mod


def run(
    target, tokenizer, prompts, variant: str, batch_size: int, max_new: int, sample: bool, folder: Path
) -> tuple[int, float, list]:
    """One `prepare_data` run of `variant` (`BACKEND@KERNELS`); returns (tokens generated, seconds, records)."""
    backend, _, kernels = variant.partition("@")
    counted = [0]
    originals = {"engine": data_mod.engine_turn, "generate": data_mod.generate_turn}

    def counting(original):
        def wrapped(*a, **kw):
            results, generated = original(*a, **kw)
            counted[0] += generated
            return results, generated

        return wrapped

    args = PrepareDataArguments(
        output=str(folder / f"{backend}-{batch_size}-{'s' if sample else 'g'}-{time.perf_counter_ns()}.jsonl"),
        backend=backend,
        kernels=kernels or None,
        batch_size=batch_size,
        max_new_tokens=max_new,
        do_sample=sample,
        seed=0,
        progress=False,
        device="cpu",
    )
    data_mod.engine_turn, data_mod.generate_turn = counting(originals["engine"]), counting(originals["generate"])
    try:
        start = time.perf_counter()
        path = data_mod.prepare_data(args, target=target, tokenizer=tokenizer, prompts=prompts)
        seconds = time.perf_counter() - start
    finally:
        data_mod.engine_turn, data_mod.generate_turn = originals["engine"], originals["generate"]
    records = [json.loads(line) for line in open(path)]
    return counted[0], seconds, records


def response_ids(tokenizer, records) -> list[list[int]]:
    return [tokenizer(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="sample,greedy", help="comma-separated: sample, greedy")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", default="engine@exact,engine@stock,generate@stock", help="BACKEND@KERNELS, ...")
    parser.add_argument("--no-compare", action="store_true", help="skip the one-at-a-time greedy run (timing only)")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    target, tokenizer = load_default_target()
    third = a.prompts // 3
    prompts = training_prompts(a.prompts - 2 * third, third, third, seed=0)[: a.prompts]
    folder = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    results: dict = {
        "host": platform.platform(),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_new_tokens": a.max_new_tokens,
        "batch_size": a.batch_size,
        "repeats": a.repeats,
        "variants": variants,
    }
    for v in variants:  # warm-up (allocator, first calls, kernel builds)
        run(target, tokenizer, prompts[:2], v, 2, 8, False, folder)
    for mode in a.modes.split(","):
        sample = mode == "sample"
        rates: dict[str, list[float]] = {v: [] for v in variants}
        tokens: dict[str, list[int]] = {v: [] for v in variants}
        last = {}
        for r in range(a.repeats):
            for v in variants if r % 2 == 0 else variants[::-1]:
                n, s, records = run(target, tokenizer, prompts, v, a.batch_size, a.max_new_tokens, sample, folder)
                rates[v].append(n / s)
                tokens[v].append(n)
                last[v] = records
                print(f"{mode:7s} {v:16s} {n:5d} tokens {s:7.1f} s {n / s:7.1f} tok/s", file=sys.stderr)
        base = variants[0]
        entry = {
            v: {
                "tokens_per_s_median": statistics.median(rates[v]),
                "tokens_per_s": rates[v],
                "tokens": tokens[v],
                f"over_{base}": statistics.median(x / y for x, y in zip(rates[v], rates[base])),
            }
            for v in variants
        }
        if not sample and not a.no_compare:
            refs = {}
            for v in variants:
                kernels = v.partition("@")[2]
                if kernels not in refs:
                    _, _, single = run(
                        target, tokenizer, prompts, f"generate@{kernels}", 1, a.max_new_tokens, False, folder
                    )
                    refs[kernels] = response_ids(tokenizer, single)
                ref, got = refs[kernels], response_ids(tokenizer, last[v])
                same = sum(x == y for x, y in zip(got, ref))
                entry[v]["identical_to_one_at_a_time_same_kernels"] = f"{same}/{len(ref)}"
        results[mode] = entry
        for v in variants:
            e = entry[v]
            extra = e.get("identical_to_one_at_a_time_same_kernels", "")
            print(f"{mode:7s} {v:16s} median {e['tokens_per_s_median']:7.1f} tok/s  {e[f'over_{base}']:.2f}x {extra}")
    print(json.dumps(results, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
