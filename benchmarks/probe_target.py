"""How good a speculative-decoding target is a model on this machine: the cost of verifying, the cost of a
draft, and how predictable the target's own text is.

For one target (a folder or Hub id; default: the default target) on the exact kernels, batch 1, it measures
- a forward over k = 1, 2, 4, 5, 8 new tokens after a 128-token cache (medians of 7): what a verified block costs
  against a plain decoding step;
- a fresh one-layer draft's round (the shipped recipe: Markov rank 64, γ = 7, whole block verified; untrained,
  so every round emits one token and the round time is draft + an 8-token verification), with and without a
  draft vocabulary of `--draft-vocab` ids (the ids of the target's own replies below, filled up with others:
  an untrained draft's cost depends only on the subset's size), next to
  plain `generate()` on the same kernels, interleaved;
- how predictable the target's greedy replies are, per evaluation set (`--prompts` prompts each, 96 new tokens):
  the mean probability of the chosen token, the share of tokens chosen with probability > 0.9, the mean
  entropy in nats. A draft's acceptance is bounded by how sure the target is: at T = 0 an argmax draft matches
  a token the target picks with probability p only as often as the draft's own guess is right, and sure
  positions are the ones a small model learns.

From the costs it prints the τ a speculative round needs to break even and to reach 1.3x and 1.5x plain
decoding on the same kernels, for whole-block (L = 7) and L = 4 rounds.

    python benchmarks/probe_target.py                                  # the default target (SmolLM2-135M)
    python benchmarks/probe_target.py --target data/coder/target       # research/2026-12-03-coder-target/convert_target.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_hf.default_model import chat_inputs, load_draft, load_target
from dspark_hf.evaluation.prompt_sets import EVAL_SETS, load_prompt_set
from dspark_hf.kernels import use_kernels


def _median_seconds(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_costs(target) -> dict[int, float]:
    ids = torch.randint(100, 5000, (1, 129))
    cache = DynamicCache(config=target.config)
    target(ids[:, :128], past_key_values=cache, use_cache=True)
    costs = {}
    for k in (1, 2, 4, 5, 8):
        x = ids[:, 128:129].repeat(1, k)

        def step(x=x, k=k):
            target(x, past_key_values=cache, use_cache=True)
            cache.crop(-k)

        step()
        costs[k] = _median_seconds(step)
    return costs


def predictability(target, tokenizer, n_prompts: int, new_tokens: int) -> tuple[dict, Counter]:
    stats, counts = {}, Counter()
    for name in EVAL_SETS:
        top1, entropy = [], []
        for item in load_prompt_set(name, limit=n_prompts):
            inputs = chat_inputs(tokenizer, item.prompt)
            out = target.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
            start = inputs["input_ids"].shape[1]
            counts.update(out[0, start:].tolist())
            probs = target(out).logits[0, start - 1 : out.shape[1] - 1].float().softmax(-1)
            top1 += probs.max(-1).values.tolist()
            entropy += (-(probs * probs.clamp_min(1e-12).log()).sum(-1)).tolist()
        stats[name] = {
            "tokens": len(top1),
            "mean_top1": round(statistics.mean(top1), 3),
            "share_top1_over_0.9": round(statistics.mean(p > 0.9 for p in top1), 3),
            "mean_entropy": round(statistics.mean(entropy), 3),
        }
        print(name, stats[name], flush=True)
    return stats, counts


def round_costs(target, tokenizer, vocab_ids: list[int] | None, repeats: int) -> dict:
    inputs = chat_inputs(tokenizer, "Write a Python function that reverses a string.")
    drafts = {"full vocabulary": load_draft(target, "fresh")[0]}
    if vocab_ids:
        drafts[f"{len(vocab_ids)}-token draft vocabulary"] = load_draft(target, "fresh")[0].set_draft_vocab(vocab_ids)
    n = 32  # no min_new_tokens: a logits processor would put the draft on its slower per-position path

    def plain():
        return target.generate(**inputs, max_new_tokens=n, do_sample=False)

    runs = {"plain": plain}
    for label, draft in drafts.items():
        runs[label] = lambda d=draft: target.generate(
            **inputs, assistant_model=d, max_new_tokens=n, do_sample=False, dspark_policy="fixed"
        )
    tokens = {label: fn().shape[1] - inputs["input_ids"].shape[1] for label, fn in runs.items()}  # and warm-up
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved
        for label, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[label].append((time.perf_counter() - start) / tokens[label])
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: the default target)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per evaluation set")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON report (default: benchmarks/results/target_<name>.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    target.eval()
    name = Path(args.target).name if args.target else "default"
    report = {
        "command": "python benchmarks/probe_target.py" + (f" --target {args.target}" if args.target else ""),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "target": target.config.name_or_path if args.target is None else args.target,
        "parameters_M": round(sum(p.numel() for p in target.parameters()) / 1e6, 1),
    }
    with use_kernels(target, mode="exact"), torch.no_grad():
        costs = forward_costs(target)
        report["forward_ms"] = {k: round(1000 * v, 2) for k, v in costs.items()}
        print("forward over k tokens (ms):", report["forward_ms"], flush=True)
        report["predictability"], counts = predictability(target, tokenizer, args.prompts, args.new_tokens)
        # the replies' tokens by frequency, filled up to --draft-vocab with other ids: an untrained draft's cost
        # depends on the subset's size only
        vocab = [t for t, _ in counts.most_common(args.draft_vocab)]
        seen = set(vocab)
        vocab += [t for t in range(target.config.vocab_size) if t not in seen][: max(0, args.draft_vocab - len(vocab))]
        rounds = round_costs(target, tokenizer, vocab if args.draft_vocab else None, args.repeats)
    plain = rounds.pop("plain")
    report["plain_ms_per_token"] = round(1000 * plain, 2)
    report["draft_ms_per_round"] = {k: round(1000 * (v - costs[8]), 2) for k, v in rounds.items()}
    needs = {}
    for label, round_s in rounds.items():
        draft_s = round_s - costs[8]
        for length in (7, 4):
            cost = costs[1 + length] + draft_s  # verification over 1 + L tokens; the draft priced at a whole block
            needs[f"{label}, L={length}"] = {f"tau for {g}x": round(g * cost / plain, 2) for g in (1.0, 1.3, 1.5)}
    report["tau_needed"] = needs
    print(json.dumps(report, indent=1))
    out = Path(
        args.out or f"benchmarks/results/target_{name}.json"
    )  # e.g. --out benchmarks/results/target_qwen2.5-coder-0.5b.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
