"""The compiled drafting round against the eager one, interleaved, on the evaluation's prompt sets.

For each prompt: speculative `generate()` with the compiled round (`draft.compiled_round = True`, the default),
the same with the eager round, and plain `generate()`, all three on the exact kernels, one after the other
(so they see the same machine load). Reports per set the speedup of each over plain decoding on the same kernels
(total time over the set's prompts) and the median time of a drafting round (the round's draft and sequential
times, lookup copies and plain rounds excluded). Greedy output is checked identical three ways.

Usage (from the repository root):
    python benchmarks/bench_compiled_round.py [--sets gsm8k humaneval mtbench sharegpt] [--limit 8]
        [--max-new-tokens 96] [--temperature 0] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import dspark_hf  # noqa: F401  (registers the generate() hook)
from dspark_hf.default_model import chat_inputs, load_default_target, load_draft
from dspark_hf.evaluation.prompt_sets import load_prompt_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "humaneval", "mtbench", "sharegpt"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    draft, _ = load_draft(target)
    sample = args.temperature > 0
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, dspark_kernels="exact")
    if sample:
        kwargs["temperature"] = args.temperature
    results = {}
    for name in args.sets:
        seconds = {"compiled": 0.0, "eager": 0.0, "plain": 0.0}
        rounds = {"compiled": [], "eager": []}
        identical = True
        for item in load_prompt_set(name, limit=args.limit):
            inputs = chat_inputs(tokenizer, item.prompt)
            outputs = {}
            for way in ("compiled", "eager"):
                draft.compiled_round = way == "compiled"
                torch.manual_seed(0)
                start = time.perf_counter()
                outputs[way] = target.generate(**inputs, assistant_model=draft, **kwargs)
                seconds[way] += time.perf_counter() - start
                rounds[way] += [
                    r.draft_time + r.sequential_time
                    for r in draft.last_generation_stats.rounds
                    if r.drafted and r.source != "lookup"
                ]
            torch.manual_seed(0)
            start = time.perf_counter()
            outputs["plain"] = target.generate(**inputs, **kwargs)
            seconds["plain"] += time.perf_counter() - start
            if not sample:
                identical &= torch.equal(outputs["compiled"], outputs["plain"])
                identical &= torch.equal(outputs["eager"], outputs["plain"])
        row = {
            "speedup_compiled": seconds["plain"] / seconds["compiled"],
            "speedup_eager": seconds["plain"] / seconds["eager"],
            "drafting_round_ms_compiled": 1e3 * statistics.median(rounds["compiled"]) if rounds["compiled"] else None,
            "drafting_round_ms_eager": 1e3 * statistics.median(rounds["eager"]) if rounds["eager"] else None,
            "drafting_rounds_compiled": len(rounds["compiled"]),
            "drafting_rounds_eager": len(rounds["eager"]),
            "greedy_identical": identical if not sample else None,
        }
        results[name] = row
        print(
            f"{name}: over plain exact, compiled {row['speedup_compiled']:.3f}x, eager {row['speedup_eager']:.3f}x; "
            f"drafting round median {row['drafting_round_ms_compiled'] or float('nan'):.2f} ms compiled "
            f"({row['drafting_rounds_compiled']} rounds), {row['drafting_round_ms_eager'] or float('nan'):.2f} ms "
            f"eager ({row['drafting_rounds_eager']}); greedy identical: {row['greedy_identical']}",
            flush=True,
        )
    if args.out:
        payload = {"args": vars(args), "machine": platform.processor() or platform.machine(), "results": results}
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
