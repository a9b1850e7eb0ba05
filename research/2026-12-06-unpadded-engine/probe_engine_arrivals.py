"""Server-like load in process: C streams, 2C held-out chat prompts, a new request as soon as one finishes, 96
tokens each. Usage: python probe_engine_arrivals.py fp32|bf16 POLICY C [profile] (from the repository root)."""
import json, sys, time, cProfile, pstats, torch
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft
torch.set_num_threads(2)
dtype = sys.argv[1]; policy = sys.argv[2]; C = int(sys.argv[3]); prof = len(sys.argv) > 4
target, tok = load_default_target(dtype=None if dtype == "fp32" else torch.bfloat16)
draft = load_draft(target)[0] if policy != "none" else None
prompts = [json.loads(l)["prompt"] for l in open("examples/default_drafts/heldout_own.jsonl")]
msgs = [[{"role": "user", "content": p}] for p in (prompts * 4)[: 2 * C]]
eng = DSparkEngine(target, draft, tok, policy=None if policy == "default" else policy, max_batch_size=C)
params = SamplingParams(max_new_tokens=96, ignore_eos=True)
def run():
    pending = list(msgs); live = 0; ntok = 0
    t = time.perf_counter()
    while pending and live < C:
        eng.add_request(pending.pop(0), params); live += 1
    while eng.has_unfinished():
        for ev in eng.step():
            ntok += len(ev.token_ids) if hasattr(ev, "token_ids") else 0
            if ev.finished:
                live -= 1
                if pending:
                    eng.add_request(pending.pop(0), params); live += 1
    return time.perf_counter() - t
run()
m0 = dict(eng.metrics.to_dict())
pr = cProfile.Profile() if prof else None
if pr: pr.enable()
wall = run()
if pr: pr.disable()
m = eng.metrics
print(f"{dtype} {policy} C={C}: {len(msgs)*96/wall:.1f} tok/s wall {wall:.2f} kernels {eng.kernels} prefill_s {m.prefill_seconds - m0['prefill_seconds']:.2f} verify_s {m.verify_seconds - m0['verify_seconds']:.2f} draft_s {m.draft_seconds - m0['draft_seconds']:.2f} rounds {m.rounds - m0['rounds']}")
if pr: pstats.Stats(pr).sort_stats("tottime").print_stats(14)
