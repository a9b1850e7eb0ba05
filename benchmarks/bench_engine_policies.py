"""Verification policies in the batched engine, in-process: tokens/s of each policy vs the same engine with no draft.

No HTTP and no server: one `DSparkEngine` per policy over the same target (the default pair, exact kernels by
default), plus one with no draft at all (`nodraft`, the baseline: what `dspark serve --policy none` runs).
Each repeat sends the same chat prompts through every engine in turn, `--concurrency` at a time (a batch of C
requests, then the next), the order of the engines alternating between repeats; the table gives each
engine's median tokens/s and the median of its per-repeat ratios to `nodraft` (each pair measured in the same
repeat). `default` is the engine's own default policy (`hardware_aware_uniform` for the shipped draft). A
`+lookup-off` (or `+lookup-on`) suffix sets the engine's prompt lookup (without one: the draft's own setting, on
for the shipped draft), e.g. `default+lookup-off`.

    python benchmarks/bench_engine_policies.py --concurrency 1 4 --policies default adaptive fixed:4 --repeats 6

Writes `benchmarks/results/engine_policies.json` (every repeat, medians, engine totals) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark_hf.decoding.engine import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft

PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Tell me a fun fact about octopuses.",
    "How does a refrigerator keep food cold?",
    "Summarise the plot of Romeo and Juliet.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", default=["default", "adaptive", "fixed:4"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--prompts",
        choices=("chat", "eval"),
        default="chat",
        help="chat: 8 short chat prompts (the default); eval: the first 4 prompts of each evaluation set, "
        "interleaved (as bench_serve.py --prompts eval)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernels", default="exact", choices=("stock", "packed", "exact", "exact-bf16"))
    parser.add_argument("--out", default="benchmarks/results/engine_policies.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tok = load_default_target()
    draft, _ = load_draft(target)
    if args.prompts == "eval":
        from bench_serve import eval_prompts

        prompts = eval_prompts()
    else:
        prompts = PROMPTS
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    batch = max(args.concurrency)
    engines = {}
    for name in args.policies:
        policy, _, lookup = name.partition("+lookup-")
        policy = None if policy == "default" else policy
        engines[name] = DSparkEngine(
            target, draft, tok, policy=policy, max_batch_size=batch, kernels=args.kernels, lookup=lookup or None
        )
    engines["nodraft"] = DSparkEngine(target, None, tok, max_batch_size=batch, kernels=args.kernels)
    params = SamplingParams(max_new_tokens=args.max_tokens)

    def run(engine, c: int) -> float:
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(texts), c):
            tokens += sum(len(o.token_ids) for o in engine.generate(texts[i : i + c], params))
        return tokens / (time.perf_counter() - start)

    samples = {c: {name: [] for name in engines} for c in args.concurrency}
    for c in args.concurrency:
        for engine in engines.values():  # warm-up
            run(engine, c)
        for rep in range(args.repeats):
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for name in order:
                samples[c][name].append(run(engines[name], c))
    rows = {}
    print(
        f"\n{args.kernels} kernels, {args.threads} threads, {len(texts)} {args.prompts} prompts x {args.max_tokens} tokens, "
        f"medians over {args.repeats} repeats"
    )
    print(f"{'C':>3} {'policy':>22} {'tok/s':>8} {'vs nodraft, paired':>19} {'drafting+copy rounds (all C)':>29}")
    for c in args.concurrency:
        base = samples[c]["nodraft"]
        for name, values in samples[c].items():
            paired = statistics.median(a / b for a, b in zip(values, base))
            rows.setdefault(str(c), {})[name] = {"tokens_per_s": statistics.median(values), "vs_nodraft_paired": paired}
            m = engines[name].metrics
            share = f"{m.drafting_rounds}+{m.lookup_rounds}/{m.rounds}" if name != "nodraft" else "-"
            print(f"{c:>3} {name:>22} {statistics.median(values):8.1f} {paired:18.3f}x {share:>29}")
    totals = {
        name: {
            "drafting_rounds": e.metrics.drafting_rounds,
            "lookup_rounds": e.metrics.lookup_rounds,
            "rounds": e.metrics.rounds,
        }
        for name, e in engines.items()
    }
    report = {
        "command": "python " + " ".join(sys.argv),
        "threads": args.threads,
        "kernels": args.kernels,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "medians": rows,
        "samples": {str(c): v for c, v in samples.items()},
        "engine_totals": totals,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
