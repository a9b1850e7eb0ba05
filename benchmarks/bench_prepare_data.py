"""Throughput of `dspark prepare-data` on the default target: backends (bulk, engine, batched `generate()`) × kernels.

A variant is `BACKEND@KERNELS` for the engine and `generate()` backends (kernels: exact, packed, stock) and
`bulk@DTYPE` for the bulk generator (bfloat16 or float32), so `bulk@bfloat16,bulk@float32` measures what the
CPU's bf16 matrix units give, side by side; a `:ROWS` suffix (`engine@exact:48`) overrides `--batch-size` for
that variant. The header names the CPU and its bf16 capability; the end, the peak
RSS of the process.

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
        [--chunk-size N] [--repeats 3] [--modes sample,greedy] \
        [--variants bulk@bfloat16,bulk@float32,engine@exact] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
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
    target,
    tokenizer,
    prompts,
    variant: str,
    batch_size: int,
    max_new: int,
    sample: bool,
    folder: Path,
    chunk_size: int | None = None,
) -> tuple[int, float, list]:
    """One `prepare_data` run of `variant` (`BACKEND@KERNELS` or `bulk@DTYPE`); returns (tokens, seconds, records)."""
    variant, _, rows = variant.partition(":")
    batch_size = int(rows) if rows else batch_size
    backend, _, setting = variant.partition("@")
    counted = [0]
    names = ("engine_turn", "generate_turn", "bulk_turn")
    originals = {name: getattr(data_mod, name) for name in names}

    def counting(original):
        def wrapped(*a, **kw):
            results, generated = original(*a, **kw)
            counted[0] += generated
            return results, generated

        return wrapped

    args = PrepareDataArguments(
        output=str(folder / f"{backend}-{batch_size}-{'s' if sample else 'g'}-{time.perf_counter_ns()}.jsonl"),
        backend=backend,
        kernels=None if backend == "bulk" else setting or None,
        generation_dtype=setting if backend == "bulk" else "auto",
        batch_size=batch_size,
        chunk_size=chunk_size if backend == "bulk" else None,
        max_new_tokens=max_new,
        do_sample=sample,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        progress=False,
        device="cpu",
    )
    for name in names:
        setattr(data_mod, name, counting(originals[name]))
    try:
        start = time.perf_counter()
        path = data_mod.prepare_data(args, target=target, tokenizer=tokenizer, prompts=prompts)
        seconds = time.perf_counter() - start
    finally:
        for name in names:
            setattr(data_mod, name, originals[name])
    records = [json.loads(line) for line in open(path)]
    return counted[0], seconds, records


def response_ids(tokenizer, records) -> list[list[int]]:
    return [tokenizer(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="rows decoded together")
    parser.add_argument("--chunk-size", type=int, default=None, help="bulk: conversations per chunk (8 x rows)")
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
    from dspark_hf.train.bulk import cpu_bf16_capability

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(
        f"CPU: {cpu}; bf16 matrix unit: {cpu_bf16_capability() or 'none'}; torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    results: dict = {
        "host": platform.platform(),
        "cpu": cpu,
        "bf16_matrix_unit": cpu_bf16_capability(),
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
                n, s, records = run(
                    target, tokenizer, prompts, v, a.batch_size, a.max_new_tokens, sample, folder, a.chunk_size
                )
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
                kernels = "stock" if v.startswith("bulk@") else v.partition("@")[2].partition(":")[0]
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
    results["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {results['peak_rss_gib']:.2f} GiB", file=sys.stderr)
    print(json.dumps(results, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
