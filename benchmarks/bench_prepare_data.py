"""Throughput of `dspark prepare-data` on the default target: the engine backend against batched `generate()`.

Both backends answer the same training prompts (`dspark_hf.evaluation.prompt_sets.training_prompts`: chat, code and math)
through `dspark_hf.train.prepare_data` itself, so the figure includes tokenization, the chat template and the
JSONL writing. Runs are interleaved (engine, generate, engine, generate, ...) in one process and the medians
over repeats are reported as generated tokens per second (each response through its end-of-turn token).

Greedy runs also compare the responses with one-at-a-time greedy decoding (`generate()` on each prompt alone,
batch 1), token for token: batched decoding is not guaranteed to be bit-identical to it (neither kernel family
is batch-invariant), so a near-tie can flip a token.

Usage:
    OMP_NUM_THREADS=2 python benchmarks/bench_prepare_data.py [--prompts 16] [--max-new-tokens 64] \
        [--batch-size 16] [--repeats 3] [--modes sample,greedy] [--out results.json]
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


def run(target, tokenizer, prompts, backend: str, batch_size: int, max_new: int, sample: bool, folder: Path):
    """One `prepare_data` run; returns (tokens generated, seconds, records)."""
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
    parser.add_argument("--no-compare", action="store_true", help="skip the one-at-a-time greedy run (timing only)")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
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
    }
    run(target, tokenizer, prompts[:2], "engine", 2, 8, False, folder)  # warm-up (allocator, first calls)
    for mode in a.modes.split(","):
        sample = mode == "sample"
        rates: dict[str, list[float]] = {"engine": [], "generate": []}
        tokens: dict[str, list[int]] = {"engine": [], "generate": []}
        last = {}
        for _ in range(a.repeats):
            for backend in ("engine", "generate"):
                n, s, records = run(target, tokenizer, prompts, backend, a.batch_size, a.max_new_tokens, sample, folder)
                rates[backend].append(n / s)
                tokens[backend].append(n)
                last[backend] = records
                print(f"{mode:7s} {backend:8s} {n:5d} tokens {s:7.1f} s {n / s:7.1f} tok/s", file=sys.stderr)
        entry = {
            backend: {"tokens_per_s_median": statistics.median(v), "tokens_per_s": v, "tokens": tokens[backend]}
            for backend, v in rates.items()
        }
        entry["engine_over_generate"] = statistics.median(e / g for e, g in zip(rates["engine"], rates["generate"]))
        if not sample and not a.no_compare:
            n, s, single = run(target, tokenizer, prompts, "generate", 1, a.max_new_tokens, False, folder)
            entry["one_at_a_time"] = {"tokens_per_s": n / s, "tokens": n}
            ref = response_ids(tokenizer, single)
            for backend in ("engine", "generate"):
                got = response_ids(tokenizer, last[backend])
                same = sum(x == y for x, y in zip(got, ref))
                first_diff = [
                    next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                    for x, y in zip(got, ref)
                    if x != y
                ]
                entry[backend]["identical_to_one_at_a_time"] = f"{same}/{len(ref)}"
                entry[backend]["first_differing_token"] = first_diff
        results[mode] = entry
    print(json.dumps(results, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
