"""Verification policies at batch 1 on the default target: tokens/s of every policy vs plain generate().

Measures, in one run and interleaved per repeat (so every method sees the same machine load):
plain `generate()`, `fixed:n` for every n in 1..γ, `adaptive` (`adaptive:n` when named), `threshold:t` for a few t, `hardware_aware` and
`hardware_aware_lagged`; reports medians over repeats of tokens/s and the ratio to plain decoding measured
in the same run. Then it sweeps a background load and records the verification length the hardware-aware
policies choose (the scheduler's load response), and plots the measured SPS curve.

The figures only mean something with a *trained* draft (`--draft`); with the default fresh draft every
drafted token is rejected and each policy only shows its overhead.

With `--candidates` only the named policies run (besides plain decoding on stock kernels and on the run's
kernels), `--kernels` picks the kernel mode (`dspark_hf.kernels`, default `exact`), `--temperature` samples
(T > 0, seeded per run), and `--no-load-sweep` skips the load sweep and plots.

Usage:
    python benchmarks/bench_policies.py [--draft PATH] [--repeats 3] [--max-new-tokens 64] [--threads 2]
    python benchmarks/bench_policies.py --kernels exact --temperature 1 --no-load-sweep \
        --candidates fixed hardware_aware hardware_aware_lagged hardware_aware_uniform --out-name policies_t1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf import last_generation_stats
from dspark_hf.default_model import chat_inputs, load_default_target, load_draft
from dspark_hf.kernels import use_kernels
from dspark_hf.scheduling.policies import HardwareAwarePolicy, LaggedHardwareAwarePolicy, UniformHardwareAwarePolicy
from dspark_hf.scheduling.sps import get_sps_profile

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
]
LOADS = [0, 4, 8, 16, 24, 32, 48, 64]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--draft",
        default=None,
        help="draft name, folder or Hub id (default: the shipped DSpark draft; 'fresh' for an untrained one)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--out-name", default="policies.json")
    parser.add_argument("--kernels", default="exact", choices=("stock", "packed", "exact", "exact-bf16"))
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (top-k/p off)")
    parser.add_argument("--candidates", nargs="+", default=None, help="only these policies (default: all)")
    parser.add_argument("--no-load-sweep", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tok = load_default_target()
    draft, _ = load_draft(target, args.draft)
    gamma = draft.config.block_size
    with use_kernels(target, mode=args.kernels):  # the cost curve generate()'s verification forwards will have
        profile = get_sps_profile(target)
    inputs = [chat_inputs(tok, p)["input_ids"] for p in PROMPTS]
    policies: dict[str, object] = {f"fixed:{n}": f"fixed:{n}" for n in range(1, gamma + 1)}
    policies.update({f"threshold:{t}": f"threshold:{t}" for t in args.thresholds})
    policies["adaptive"] = "adaptive"  # adaptive:4; any other adaptive:n runs when named in --candidates
    policies["hardware_aware"] = HardwareAwarePolicy(sps=profile)
    policies["hardware_aware_lagged"] = LaggedHardwareAwarePolicy(sps=profile)
    policies["hardware_aware_uniform"] = UniformHardwareAwarePolicy(sps=profile)
    policies["fixed"] = "fixed"
    if args.candidates:
        policies.update({n: n for n in args.candidates if n.startswith("adaptive:")})
        unknown = set(args.candidates) - set(policies)
        if unknown:
            raise SystemExit(f"unknown --candidates {sorted(unknown)}; choose from {sorted(policies)}")
        policies = {n: policies[n] for n in args.candidates}
    sample = args.temperature > 0
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, pad_token_id=tok.eos_token_id)
    if sample:
        kw.update(temperature=args.temperature, top_k=0, top_p=1.0)

    def run(ids, policy, kernels=args.kernels):
        torch.manual_seed(0)
        start = time.perf_counter()
        if policy is None:
            out = target.generate(ids, dspark_kernels=kernels, **kw)
        else:
            out = target.generate(ids, assistant_model=draft, dspark_policy=policy, dspark_kernels=kernels, **kw)
        elapsed = time.perf_counter() - start
        return (out.shape[1] - ids.shape[1]) / elapsed, (last_generation_stats(draft) if policy is not None else None)

    run(inputs[0], None)  # warm-up
    run(inputs[0], None, "stock")
    names = ["plain", "plain_stock"] + list(policies)
    tps: dict[str, list[float]] = {n: [] for n in names}
    taus: dict[str, list[float]] = {n: [] for n in names[2:]}
    verified: dict[str, list[float]] = {n: [] for n in names[2:]}
    for _ in range(args.repeats):
        for ids in inputs:
            for name in names:  # interleaved
                if name == "plain_stock":
                    rate, stats = run(ids, None, "stock")
                else:
                    rate, stats = run(ids, None if name == "plain" else policies[name])
                tps[name].append(rate)
                if stats is not None:
                    taus[name].append(stats.tau)
                    verified[name].append(stats.mean_verified)
    plain = statistics.median(tps["plain"])
    plain_stock = statistics.median(tps["plain_stock"])
    rows = {
        n: {
            "tokens_per_s": statistics.median(tps[n]),
            "ratio_vs_plain": statistics.median(tps[n]) / plain,
            "ratio_vs_plain_stock": statistics.median(tps[n]) / plain_stock,
            "tau": statistics.median(taus[n]) if n in taus else 1.0,
            "mean_verified": statistics.median(verified[n]) if n in verified else 0.0,
        }
        for n in names
    }
    fixed_names = [n for n in names if n.startswith("fixed")]
    best_fixed = max(fixed_names, key=lambda n: rows[n]["tokens_per_s"]) if fixed_names else None
    print(
        f"\nbatch 1, {args.threads} threads, {args.kernels} kernels, T={args.temperature}, medians over "
        f"{args.repeats} repeats x {len(inputs)} prompts ('plain' runs on the same kernels, 'plain_stock' on stock)"
    )
    print(f"{'policy':24} {'tok/s':>8} {'vs plain':>9} {'vs stock':>9} {'tau':>6} {'verified':>9}")
    for n, r in rows.items():
        print(
            f"{n:24} {r['tokens_per_s']:8.2f} {r['ratio_vs_plain']:8.2f}x {r['ratio_vs_plain_stock']:8.2f}x "
            f"{r['tau']:6.2f} {r['mean_verified']:9.2f}"
        )
    print(f"best fixed: {best_fixed}")

    # load response: chosen verification length vs background tokens
    load_curve = {}
    for cls in () if args.no_load_sweep else (HardwareAwarePolicy, LaggedHardwareAwarePolicy):
        lengths = []
        for load in LOADS:
            target.generate(
                inputs[0],
                assistant_model=draft,
                dspark_policy=cls(sps=profile, background_tokens=load),
                **{**kw, "max_new_tokens": 32},
            )
            lengths.append(last_generation_stats(draft).mean_verified)
        load_curve[cls.name] = lengths
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python " + " ".join(sys.argv),
        "dspark_hf": dspark_hf.__version__,
        "draft": args.draft or "the shipped DSpark draft",
        "threads": args.threads,
        "kernels": args.kernels,
        "temperature": args.temperature,
        "sps_profile_seconds": profile.seconds,
        "policies": rows,
        "best_fixed": best_fixed,
        "background_loads": LOADS,
        "mean_verified_vs_load": load_curve,
    }
    (out_dir / args.out_name).write_text(json.dumps(report, indent=2))
    if args.no_load_sweep:
        print(f"wrote {out_dir / args.out_name}")
        return
    _plot(profile, load_curve, rows, out_dir)
    print(f"wrote {out_dir / args.out_name}, sps_curve.png, load_response.png")


def _plot(profile, load_curve, rows, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(1, max(profile.seconds) + 1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [1000 * profile.time(x) for x in xs], label="interpolated")
    ax.scatter(list(profile.seconds), [1000 * v for v in profile.seconds.values()], color="C1", label="measured")
    ax.set_xlabel("tokens in the verification forward (B)")
    ax.set_ylabel("ms per forward")
    ax.set_title("Target verification cost (SPS profile)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "sps_curve.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, lengths in load_curve.items():
        ax.plot(LOADS, lengths, marker="o", label=name)
    ax.set_xlabel("background tokens in the verification forward")
    ax.set_ylabel("mean drafted tokens verified per round")
    ax.set_title("Scheduler's verification length vs load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "load_response.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
