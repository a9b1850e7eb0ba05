"""Prompt lookup's search settings (`LookupConfig`) in `generate(assistant_model=draft)`: speed-up and τ of each.

One `dspark eval` run (greedy, the default pair, the evaluation sets) in which every method is the shipped
draft with a different `dspark_lookup`: `off`, or `TOKENS:MAX_NGRAM:MIN_NGRAM` (the most tokens a copy proposes,
the longest and the shortest suffix searched for; the default is 7:3:2). All methods are interleaved prompt
by prompt with plain `generate()` on the stock and on the same (exact) kernels, so the ratios share their
baselines.

    python research/2026-12-03-prompt-lookup/sweep_lookup.py --configs off 7:3:2 10:3:2 7:4:2 7:3:1 --limit 4 --repeats 2

Prints each setting's macro speed-up over plain decoding on the same kernels and on stock kernels, and τ; writes `benchmarks/results/sweep_lookup.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspark_hf.decoding.lookup import LookupConfig
from dspark_hf.default_model import load_default_target, load_draft
from dspark_hf.evaluation.harness import evaluate_drafts


def parse_config(text: str) -> LookupConfig | bool:
    """`off` -> False; `TOKENS:MAX_NGRAM:MIN_NGRAM` -> that `LookupConfig`."""
    if text == "off":
        return False
    try:
        tokens, longest, shortest = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--configs takes `off` or TOKENS:MAX_NGRAM:MIN_NGRAM (e.g. 7:3:2), got {text!r}") from None
    return LookupConfig(max_tokens=tokens, max_ngram=longest, min_ngram=shortest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["off", "7:3:2", "10:3:2", "7:4:2", "7:3:1"])
    parser.add_argument("--limit", type=int, default=4, help="first N prompts of each evaluation set")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/sweep_lookup.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = {name: parse_config(name) for name in args.configs}
    target, tok = load_default_target()
    draft, _ = load_draft(target)
    report = evaluate_drafts(
        target, tok, {name: draft for name in configs}, limit=args.limit, temperatures=(0.0,),
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, lookup=configs, prompt_lookup=False,
        task_metrics=False, kernels="exact",
    )  # fmt: skip
    summary = report.summary()
    macro = report.macro(summary)["0"]
    rows = {}
    print(f"\n{'lookup':>8} {'vs plain, same kernels':>23} {'vs plain, stock':>16} {'tau':>6}")
    for name in configs:
        m = macro[name]
        rows[name] = {k: m[k] for k in ("speedup", "speedup_vs_exact", "tau")}
        print(f"{name:>8} {m['speedup_vs_exact']:22.3f}x {m['speedup']:15.3f}x {m['tau']:6.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    per_set = {s: {n: summary[s]["0"][n].get("speedup_vs_exact") for n in configs} for s in report.sets}
    out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "macro": rows, "per_set": per_set}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
