"""Probe: why the engine ran slower in a worker thread (as `dspark serve` runs it) once a draft was loaded.

Cause, found with this script: GNU OpenMP keeps one helper-thread pool per thread that opens a parallel region.
Loading the draft on the main thread opened the main thread's first one, so the process held two pools (main and
worker); with more pooled threads than CPUs libgomp throttles the idle spin, and every parallel region of every
round then pays a futex sleep and wake-up. `dspark_hf.serve.load_app` now loads in a thread that exits
(`dspark_hf._threads.run_in_fresh_thread`). One process per mode, one mode per process:

- `none`: the engine without a draft (nothing parallel ran on the main thread);
- `none+mainomp`: the same, after one parallel kernel on the main thread (no draft at all);
- `none+draft`: the shipped draft loaded on the main thread, the engine still without speculation;
- `none+draft-fresh`: the draft loaded in a thread that exits (what `load_app` does now);
- `default`: the engine with the draft (loaded on the main thread) and its default policy.

The engine decodes 4 chat prompts × 24 tokens, 4 times, in a worker thread; the script prints tokens/s, the
engine's verification seconds (target forwards) over the same rounds, and the process's voluntary context
switches over the run (`getrusage`). Run the modes alternately, e.g.:

    for rep in 1 2; do for m in none none+mainomp none+draft none+draft-fresh; do
        python research/2026-12-02-engine-worker-thread/probe_worker_thread.py $m; done; done

Findings are on the serving page (`docs/serving.md`, benchmark section).
"""

from __future__ import annotations

import resource
import sys
import threading
import time

import torch

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf._threads import run_in_fresh_thread
from dspark_hf.default_model import load_default_target, load_draft

PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
]
MODES = ("none", "none+mainomp", "none+draft", "none+draft-fresh", "default")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "none"
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    torch.set_num_threads(2)
    target, tok = load_default_target()
    draft = None
    if mode == "none+mainomp":
        torch.empty(1 << 22).exp_()  # one parallel region on the main thread, nothing else
    elif mode == "none+draft-fresh":
        draft = run_in_fresh_thread(lambda: load_draft(target)[0])
    elif mode != "none":
        draft = load_draft(target)[0]
    engine = DSparkEngine(target, draft, tok, policy=None if mode == "default" else "none", max_batch_size=4)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    rates = []

    def run() -> None:
        for _ in range(4):
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    m = engine.metrics
    print(
        f"{mode}: tok/s {[round(r, 1) for r in rates]}, verify {m.verify_seconds:.2f} s over {m.rounds} rounds, "
        f"{switches} voluntary context switches"
    )


if __name__ == "__main__":
    main()
