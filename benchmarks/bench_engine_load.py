"""Load benchmark of the batched engine on the default target (SmolLM2-135M-Instruct): throughput vs concurrency.

For each concurrency R (R requests submitted together, `max_batch_size=R`) and each decoding mode, all run
through the same `DSparkEngine` and interleaved within every repeat (so every mode sees the same machine
load):

* `none`: plain batched decoding, no drafting (`policy="none"`);
* `fixed:1`, `fixed:3` and `fixed` (ℓ = γ): fixed verification lengths;
* `hardware_aware` (paper Algorithm 1) and `hardware_aware_lagged` (§5.2), on the target's measured SPS
  profile, scheduling the whole batch's survival matrix;
* `hardware_aware_uniform`: one length for the batch, fixed before drafting from the SPS profile, the
  survival of earlier rounds and the drafting and bookkeeping costs it measures (`0`: skip drafting).

Reported per (R, mode): aggregate tokens/s (all generated tokens / wall time), per-request tokens/s (median
over requests, each from its admission to its end), τ, mean verification length, mean verification-forward
size: medians over repeats, and every repeat's aggregate tokens/s (the noise band). A second, optional part
(`--layout-bench`) times one ragged verification forward in the `padded` and `packed` layouts at several R
and context lengths (which layout is faster here).

By default the shipped, trained DSpark draft is used; with `--draft fresh` (an untrained draft) nearly every
drafted token is rejected and the speculative modes only show their overhead against `none`.

Usage:
    python benchmarks/bench_engine_load.py [--draft NAME|PATH|fresh] [--concurrency 1 2 4 8 16 32] [--repeats 3]
        [--max-new-tokens 64] [--layout padded] [--layout-bench] [--threads 2] [--device cuda --dtype bfloat16]
        [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.decoding.target_forward import KVStore, ragged_target_forward
from dspark_hf.default_model import load_default_target, load_draft
from dspark_hf.evaluation.harness import synchronize
from dspark_hf.kernels import default_kernels, use_kernels
from dspark_hf.scheduling.policies import HardwareAwarePolicy, LaggedHardwareAwarePolicy, UniformHardwareAwarePolicy
from dspark_hf.scheduling.sps import get_sps_profile

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a ten-year-old.",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "List the planets of the solar system in order from the sun.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your work.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Write a SQL query that counts the rows of a table named users.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What are the three states of matter?",
    "Write a limerick about a cat who loves to code.",
    "Explain the difference between a list and a tuple in Python.",
]
MODES = ["none", "fixed:1", "fixed:3", "fixed", "hardware_aware", "hardware_aware_lagged", "hardware_aware_uniform"]


def make_policy(mode: str, profile):
    if mode == "hardware_aware":
        return HardwareAwarePolicy(sps=profile)
    if mode == "hardware_aware_lagged":
        return LaggedHardwareAwarePolicy(sps=profile)
    if mode == "hardware_aware_uniform":
        return UniformHardwareAwarePolicy(sps=profile)
    return mode


def run_load(target, draft, tok, prompts, mode, profile, args) -> dict:
    """One batch of `len(prompts)` concurrent requests through a fresh engine; returns its measurements."""
    engine = DSparkEngine(
        target,
        draft,
        tok,
        policy=make_policy(mode, profile),
        max_batch_size=len(prompts),
        layout=args.layout,
        kernels=args.kernels,
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    per_request = [o.summary()["tokens_per_second"] for o in outputs]
    m = engine.metrics
    return {
        "aggregate_tokens_per_s": sum(len(o.token_ids) for o in outputs) / wall,
        "per_request_tokens_per_s": statistics.median(per_request),
        "tau": m.tau,
        "mean_verification_length": m.mean_verification_length,
        "mean_forward_tokens": m.to_dict()["mean_forward_tokens"],
        "mean_computed_tokens": m.to_dict()["mean_computed_tokens"],  # padding included
        "drafting_share": m.drafting_rounds / m.rounds if m.rounds else 0.0,  # rounds that ran the draft
        "draft_ms_per_drafting_round": 1000 * m.draft_seconds / m.drafting_rounds if m.drafting_rounds else 0.0,
        "verify_ms_per_round": 1000 * m.verify_seconds / m.rounds if m.rounds else 0.0,
        "rounds": m.rounds,
        "new_tokens": m.tokens_generated,
        "wall_s": wall,
    }


def layout_bench(target, concurrency, contexts, gamma, repeats) -> list[dict]:
    """Seconds (min and median over repeats) of one verification forward over R rows, padded vs packed.

    Each row holds a real `ctx`-token KV cache; "single" rows decode one token (no speculation), "uniform"
    rows all verify γ drafts (γ+1 tokens), "ragged" rows 1..γ+1 tokens, the spread a confidence scheduler
    produces.
    """
    vocab = target.config.vocab_size
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for ctx in contexts:
        for r in concurrency:
            stores = [KVStore(ctx + gamma + 1) for _ in range(r)]
            prompts = [torch.randint(0, vocab, (ctx,), generator=gen).tolist() for _ in range(r)]
            out = ragged_target_forward(target, stores, prompts, [[ctx - 1]] * r)  # a real ctx-token cache per row
            for store, kv in zip(stores, out.new_kv):
                store.append(kv)
            for shape in ("single", "uniform", "ragged"):
                if shape == "single":  # plain decoding: one token per row
                    counts = [1] * r
                elif shape == "uniform":
                    counts = [gamma + 1] * r
                else:  # the spread a confidence scheduler produces: 1..γ+1 tokens per row
                    counts = [1 + (i * 3) % (gamma + 1) for i in range(r)]
                rows = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in counts]
                keep = [list(range(n)) for n in counts]
                row = {"context": ctx, "R": r, "shape": shape, "tokens": sum(counts)}
                times = {"padded": [], "packed": []}
                for i in range(repeats + 1):
                    for layout in times:  # interleaved, so both layouts see the same machine load
                        t0 = time.perf_counter()
                        ragged_target_forward(target, stores, rows, keep, layout=layout)
                        synchronize(target.device)  # count the GPU's work, not just its launch
                        if i:  # the first round is warm-up
                            times[layout].append(time.perf_counter() - t0)
                for layout, ts in times.items():
                    # the minimum is the least disturbed by other processes on a shared machine
                    row[f"{layout}_ms"] = 1000 * min(ts)
                    row[f"{layout}_median_ms"] = 1000 * statistics.median(ts)
                row["packed_speedup"] = row["padded_ms"] / row["packed_ms"]
                print(
                    f"ctx={ctx:4d} R={r:3d} {shape:8s} B={row['tokens']:4d} padded {row['padded_ms']:8.1f} ms  "
                    f"packed {row['packed_ms']:8.1f} ms  (padded/packed {row['packed_speedup']:.2f})"
                )
                rows_out.append(row)
    return rows_out


def plot(report: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    conc = sorted({int(r) for r in results})
    panels = [
        ("aggregate_tokens_per_s", "aggregate tokens/s"),
        ("per_request_tokens_per_s", "per-request tokens/s (median)"),
        ("mean_verification_length", "mean verification length ℓ"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels):
        for mode in report["modes"]:
            ys = [results[str(r)][mode][key] for r in conc]
            ax.plot(conc, ys, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests R")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    where = f"{report['threads']} threads" if report.get("device", "cpu") == "cpu" else report["device"]
    fig.suptitle(f"DSparkEngine on {report['target']} ({where}, draft: {report['draft']})")
    fig.tight_layout()
    path = out_dir / "engine_load.png"
    fig.savefig(path, dpi=120)
    return [str(path)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--draft",
        default=None,
        help="draft: a shipped name, folder or Hub id, or `fresh` (default: the shipped DSpark draft)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_new_tokens")
    parser.add_argument("--layout", default="padded", choices=["padded", "packed"])
    parser.add_argument("--layout-bench", action="store_true", help="also time padded vs packed forwards")
    parser.add_argument("--layout-contexts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=None, help="e.g. cuda (default: cpu)")
    parser.add_argument("--dtype", default=None, help="target and draft dtype: float32 (default), bfloat16, float16")
    parser.add_argument(
        "--kernels",
        choices=["stock", "packed", "exact", "exact-bf16"],
        default=None,
        help="the target's CPU kernels in every mode, `none` included (default: the library's for the target, as "
        "`dspark serve` runs it: exact for a float32 CPU Llama/Qwen target)",
    )
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    target, tok = load_default_target(dtype=args.dtype, device=args.device)
    draft, _ = load_draft(target, args.draft)
    args.kernels = args.kernels or default_kernels(target)
    with use_kernels(target, mode=args.kernels):  # the cost curve the engine's forwards will have
        profile = get_sps_profile(target)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    report = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "dspark_hf": dspark_hf.__version__,
        "machine": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu",
        "dtype": str(target.dtype).replace("torch.", ""),
        "threads": args.threads,
        "target": "SmolLM2-135M-Instruct",
        "draft": args.draft or "smollm2-135m-dspark (shipped default)",
        "block_size": draft.config.block_size,
        "layout": args.layout,
        "kernels": args.kernels,
        "max_new_tokens": args.max_new_tokens,
        "sps_seconds": profile.seconds,
        "modes": args.modes,
        "results": {},
    }
    run_load(target, draft, tok, chats[:2], "fixed", profile, args)  # warm-up
    for r in args.concurrency:
        prompts = [chats[i % len(chats)] for i in range(r)]
        samples = {mode: [] for mode in args.modes}
        for _ in range(args.repeats):
            for mode in args.modes:  # interleaved: every mode sees the same load within a repeat
                samples[mode].append(run_load(target, draft, tok, prompts, mode, profile, args))
        report["results"][str(r)] = {
            mode: {
                **{k: statistics.median(s[k] for s in runs) for k in runs[0]},
                # the spread over repeats: the noise band of the medians
                "aggregate_tokens_per_s_runs": [s["aggregate_tokens_per_s"] for s in runs],
            }
            for mode, runs in samples.items()
        }
        for mode, row in report["results"][str(r)].items():
            print(
                f"R={r:3d} {mode:22s} aggregate {row['aggregate_tokens_per_s']:7.1f} tok/s  per-request "
                f"{row['per_request_tokens_per_s']:6.1f} tok/s  tau {row['tau']:.2f}  "
                f"mean ℓ {row['mean_verification_length']:.2f}  B {row['mean_forward_tokens']:.1f}"
            )
    if args.layout_bench:
        report["layout_bench"] = layout_bench(
            target, args.concurrency, args.layout_contexts, draft.config.block_size, max(args.repeats, 3)
        )
    report["plots"] = plot(report, out_dir)
    path = out_dir / "engine_load.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path} and {report['plots']}")


if __name__ == "__main__":
    main()
