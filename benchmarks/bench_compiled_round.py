"""The compiled drafting round against the eager one, interleaved, on the evaluation's prompt sets.

For each prompt: speculative `generate()` with the compiled round (`dspark_compiled=True`, the default),
the same with the eager round, and plain `generate()`, all three on the exact kernels, one after the other
(so they see the same machine load). Reports per set the speedup of each over plain decoding on the same kernels
(total time over the set's prompts) and the median time of a drafting round (the round's draft and sequential
times, lookup copies and plain rounds excluded). Greedy output is checked identical three ways.

`--pieces` first times each piece of one drafting round alone, eager and compiled, warm (repeated) and cold (a
600 MB pass over memory before each call, as the target's forward leaves the caches): medians of 30 calls.

Usage (from the repository root):
    python benchmarks/bench_compiled_round.py [--sets gsm8k humaneval mtbench sharegpt] [--limit 8]
        [--max-new-tokens 96] [--temperature 0] [--threads 2] [--pieces] [--out FILE]
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
from dspark_hf import last_generation_stats
from dspark_hf.default_model import chat_inputs, load_default_target, load_draft
from dspark_hf.evaluation.prompt_sets import load_prompt_set


def time_pieces(target, draft) -> dict:
    """Medians (ms) of each piece of a drafting round, eager and compiled, warm and cold (see the module docs)."""
    from dspark_hf.decoding.caches import KVStore
    from dspark_hf.decoding.compiled import CompiledRound
    from dspark_hf.decoding.drafting import SharedSampler, draft_block, ingest, sample_block
    from dspark_hf.kernels import use_kernels

    evict = torch.zeros(600_000_000 // 4)
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    out = {}
    with use_kernels(target, draft, mode="exact"), torch.no_grad():
        eager_store, compiled_store = KVStore(1024), KVStore(1024)
        context = torch.randn(150, width)
        ingest(draft, [eager_store], [context])
        compiled = CompiledRound.create(draft, 1024)
        compiled.ingest(compiled_store, context)
        one = torch.randn(1, width)
        anchors = torch.tensor([42])
        hidden, base = draft_block(draft, [eager_store], anchors, positions=4)
        c_hidden, c_base = compiled.block(compiled_store, 42, 4)
        pieces = {
            "eager: context projection (1 token)": lambda: draft.project_context(one[None]),
            "eager: draft keys/values (1 token)": lambda: draft.context_kv(
                one[None, :, : draft.config.hidden_size], torch.tensor([[150]])
            ),
            "eager: block + 4 LM-head rows": lambda: draft_block(draft, [eager_store], anchors, positions=4),
            "eager: sequential + confidence heads": lambda: sample_block(
                draft, hidden, base, anchors, SharedSampler(None, torch.tensor([[1, 42]]), False)
            ),
            "compiled: draft_ingest (1 token)": lambda: (
                compiled.ingest(compiled_store, one),
                setattr(compiled_store, "length", 150),
            ),
            "compiled: draft_block_run (4 rows)": lambda: compiled.block(compiled_store, 42, 4),
            "compiled: markov_greedy": lambda: compiled.greedy(c_hidden, c_base, 42),
        }
        for cold in (False, True):
            for name, call in pieces.items():
                times = []
                for _ in range(30):
                    if cold:
                        evict.add_(1.0)
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                key = f"{name}, {'cold' if cold else 'warm'}"
                out[key] = 1e3 * statistics.median(times)
                print(f"{key}: {out[key]:.3f} ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "humaneval", "mtbench", "sharegpt"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pieces", action="store_true", help="first time the round's pieces alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    draft, _ = load_draft(target)
    draft.bind_target(target)
    pieces = time_pieces(target, draft) if args.pieces else None
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
                draft.generation_config.dspark_compiled = way == "compiled"  # the draft's default: every call
                torch.manual_seed(0)
                start = time.perf_counter()
                outputs[way] = target.generate(**inputs, assistant_model=draft, **kwargs)
                seconds[way] += time.perf_counter() - start
                rounds[way] += [
                    r.draft_time + r.sequential_time
                    for r in last_generation_stats(draft).rounds
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
        if pieces is not None:
            payload["pieces_ms"] = pieces
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
