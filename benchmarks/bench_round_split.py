"""Per-round time split of DSpark speculative generation, and the sequential head's overhead vs `none`.

For each target (a tiny random Llama and SmolLM2-135M-Instruct) and each sequential head type, a fresh
draft drafts γ tokens per round (fixed policy, greedy) and the per-round time is split into the draft
backbone, the sequential loop (sequential + confidence heads and sampling) and target verification.
Heads are interleaved within every repeat so they see the same machine load; medians over repeats are
reported. The headline number is the sequential head's overhead: the extra sequential-loop time of a head
over `none`, as a share of the `none` round time (goal: <= 5% at batch 1 on CPU). The whole-round
difference is printed too, but it also carries the verification forward's run-to-run noise.

A fresh draft is used on purpose: with τ ≈ 1 every round verifies a full block, so rounds are comparable
across heads; the overhead does not depend on acceptance. `none` is DFlash (the same backbone, no
sequential head), so the `markov` row against the `none` row is DSpark vs DFlash at the same backbone.
"host" is the round's wall time not covered by the three measured phases (transformers' bookkeeping and
ours).

`--engine` adds the engine's plain batched mode (`DSparkEngine(target, policy="none")`) against plain
`generate()` at R = 1, interleaved, in tokens per second.

The script uses only public API, so the same file measures an older checkout: run it with
`PYTHONPATH=<checkout>/src` to get the "before" figures.

Usage:
    python benchmarks/bench_round_split.py [--targets tiny smollm] [--repeats 5] [--threads 2] [--engine] [--out FILE]
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
from dspark_hf import DSparkDraftModel, last_generation_stats

HEADS = ["none", "markov", "gated", "rnn"]
PROMPTS = [
    "Explain why the sky is blue.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
]


def load_target(name: str):
    if name == "smollm":
        from dspark_hf.default_model import load_default_target

        target, tok = load_default_target()
        inputs = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            for p in PROMPTS
        ]
        return target, inputs
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    return target, [torch.randint(0, 4096, (1, n), generator=gen) for n in (24, 40, 56)]


def measure(target, inputs, draft, max_new_tokens: int) -> dict:
    """One pass over the prompts; returns mean per-round seconds of each phase."""
    totals = {"draft_backbone": 0.0, "sequential_loop": 0.0, "target_verification": 0.0}
    rounds = 0
    wall = 0.0
    for ids in inputs:
        start = time.perf_counter()
        target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, pad_token_id=0)
        wall += time.perf_counter() - start
        stats = last_generation_stats(draft)
        for key, value in stats.time_split().items():
            totals[key] += value
        rounds += stats.num_rounds
    out = {key: value / rounds for key, value in totals.items()}
    out["round"] = sum(out.values())
    out["wall_per_round"] = wall / rounds
    out["host"] = out["wall_per_round"] - out["round"]
    return out


def engine_vs_generate(target, inputs, max_new_tokens: int, repeats: int) -> dict:
    """Tokens/s of plain `generate()` and of the engine's plain batched mode at R = 1, interleaved."""
    from dspark_hf import DSparkEngine, SamplingParams

    engine = DSparkEngine(target, None, policy="none", max_batch_size=1)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    plain, batched = [], []
    for _ in range(repeats):
        for ids in inputs:
            start = time.perf_counter()
            out = target.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
            plain.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
            start = time.perf_counter()
            res = engine.generate([ids[0].tolist()], params)[0]
            batched.append(len(res.token_ids) / (time.perf_counter() - start))
    plain_tps, engine_tps = statistics.median(plain), statistics.median(batched)
    return {"plain_generate_tok_s": plain_tps, "engine_none_r1_tok_s": engine_tps, "ratio": engine_tps / plain_tps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["tiny", "smollm"], choices=["tiny", "smollm"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--markov-rank", type=int, default=64)
    parser.add_argument("--engine", action="store_true", help="also: engine plain batched vs generate() at R = 1")
    parser.add_argument("--out", default="benchmarks/results/round_split.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    report = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "dspark_hf": dspark_hf.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "results": {},
    }
    for name in args.targets:
        target, inputs = load_target(name)
        drafts = {}
        for head in HEADS:
            torch.manual_seed(1)
            drafts[head] = DSparkDraftModel.from_target(
                target, sequential_head=head, num_hidden_layers=args.draft_layers, markov_rank=args.markov_rank
            ).eval()
        measure(target, inputs[:1], drafts["none"], 8)  # warm-up
        samples: dict[str, list[dict]] = {h: [] for h in HEADS}
        for _ in range(args.repeats):
            for head in HEADS:  # interleaved: every head sees the same load within a repeat
                samples[head].append(measure(target, inputs, drafts[head], args.max_new_tokens))
        med = {h: {k: statistics.median(s[k] for s in samples[h]) for k in samples[h][0]} for h in HEADS}
        rows = {}
        for head in HEADS:
            m = med[head]
            rows[head] = {
                **{f"{k}_ms": 1000 * v for k, v in m.items()},
                "sequential_share_of_round": m["sequential_loop"] / m["round"],
                # the head's own cost: extra sequential-loop time over `none`, as a share of the `none` round
                # (robust to verification-time noise, which is the same work for every head)
                "sequential_overhead_vs_none": (m["sequential_loop"] - med["none"]["sequential_loop"])
                / med["none"]["round"],
                # paired per repeat, then the median: robust to load drifting between repeats
                "overhead_vs_none": statistics.median(
                    (s["round"] - n["round"]) / n["round"] for s, n in zip(samples[head], samples["none"])
                ),
            }
        report["results"][name] = rows
        print(f"\n== {name}: per-round medians over {args.repeats} repeats ({args.threads} threads)")
        print(
            f"{'head':8} {'backbone':>9} {'seq loop':>9} {'verify':>9} {'host':>9} {'round':>9} {'seq share':>10} "
            f"{'head overhead':>14} {'round vs none':>14}"
        )
        for head, r in rows.items():
            print(
                f"{head:8} {r['draft_backbone_ms']:8.1f}m {r['sequential_loop_ms']:8.1f}m "
                f"{r['target_verification_ms']:8.1f}m {r['host_ms']:8.1f}m {r['round_ms']:8.1f}m "
                f"{100 * r['sequential_share_of_round']:9.1f}% {100 * r['sequential_overhead_vs_none']:+13.1f}% "
                f"{100 * r['overhead_vs_none']:+13.1f}%"
            )
        if args.engine:
            rows_engine = engine_vs_generate(target, inputs, args.max_new_tokens, args.repeats)
            report["results"][name + "_engine_r1"] = rows_engine
            print(
                f"plain generate() {rows_engine['plain_generate_tok_s']:.1f} tok/s, engine plain batched R=1 "
                f"{rows_engine['engine_none_r1_tok_s']:.1f} tok/s: {rows_engine['ratio']:.2f}x"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
