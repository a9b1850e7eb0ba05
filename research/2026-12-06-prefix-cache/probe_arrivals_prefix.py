"""Server-like load in process, prefix cache on and off in one process: C streams, 2C held-out chat prompts, a
new request as soon as one finishes, 96 tokens each; the cache emptied before every run (as bench_vs_vllm's
default empties it before every level). Usage: python probe_arrivals_prefix.py fp32|bf16 POLICY C REPEATS
(from the repository root). Prints tokens/s per run, alternating off / on, and the hit tokens."""

import json, sys, time, torch
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft

torch.set_num_threads(2)
dtype, policy, C, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
target, tok = load_default_target(dtype=None if dtype == "fp32" else torch.bfloat16)
draft = load_draft(target)[0] if policy != "none" else None
prompts = [json.loads(l)["prompt"] for l in open("examples/default_drafts/heldout_own.jsonl")]
msgs = [[{"role": "user", "content": p}] for p in (prompts * 4)[: 2 * C]]
pol = None if policy == "default" else policy
engines = {c: DSparkEngine(target, draft, tok, policy=pol, max_batch_size=C, prefix_cache_bytes=c) for c in (0, None)}
params = SamplingParams(max_new_tokens=96, ignore_eos=True)


def run(eng):
    if eng.prefix_cache is not None:
        eng.reset_prefix_cache()
    pending = list(msgs)
    live = 0
    hits0 = eng.metrics.prefix_cache_hit_tokens
    t = time.perf_counter()
    while pending and live < C:
        eng.add_request(pending.pop(0), params)
        live += 1
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.finished:
                live -= 1
                if pending:
                    eng.add_request(pending.pop(0), params)
                    live += 1
    return time.perf_counter() - t, eng.metrics.prefix_cache_hit_tokens - hits0


for c, eng in engines.items():
    run(eng)  # warm-up
for r in range(repeats):
    for c, eng in engines.items() if r % 2 == 0 else reversed(engines.items()):
        wall, hits = run(eng)
        print(
            f"{dtype} {policy} C={C} cache={'off' if c == 0 else 'on'}: {len(msgs) * 96 / wall:.1f} tok/s, hit tokens {hits}",
            flush=True,
        )
