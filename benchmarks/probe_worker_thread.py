"""Probe: does loading a draft slow the target's forwards in a worker thread (as `dspark serve` runs the engine)?

One process per run, one mode per process: `none` (the engine without a draft), `none+draft` (the shipped
draft loaded into the process, the engine still without speculation) and `default` (the engine with the draft
and its default policy). The engine decodes 4 chat prompts × 24 tokens, 4 times, in a worker thread; the
script prints tokens/s and the engine's verification seconds (target forwards) over the same rounds.
Run the modes alternately, e.g.:

    for rep in 1 2; do for m in none default none+draft; do python benchmarks/probe_worker_thread.py $m; done; done
    OMP_WAIT_POLICY=PASSIVE python benchmarks/probe_worker_thread.py none+draft

Findings are on the serving page (`docs/serving.md`, benchmark section).
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft

PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
]


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "none"
    if mode not in ("none", "none+draft", "default"):
        raise SystemExit(f"mode must be none, none+draft or default, got {mode!r}")
    torch.set_num_threads(2)
    target, tok = load_default_target()
    draft = load_draft(target)[0] if mode != "none" else None
    engine = DSparkEngine(target, draft, tok, policy=None if mode == "default" else "none", max_batch_size=4)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    rates = []

    def run() -> None:
        for _ in range(4):
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    m = engine.metrics
    print(f"{mode}: tok/s {[round(r, 1) for r in rates]}, verify {m.verify_seconds:.2f} s over {m.rounds} rounds")


if __name__ == "__main__":
    main()
