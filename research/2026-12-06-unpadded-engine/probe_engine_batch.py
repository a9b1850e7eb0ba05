"""R held-out chat prompts submitted at once to DSparkEngine, 96 tokens each (EOS ignored): tokens/s and the
engine's prefill / verify / draft seconds. Usage: python probe_engine_batch.py KERNELS POLICY R [MAX_PREFILL_TOKENS] [profile]
(from the repository root; POLICY none|default). Run twice in one process; the second run is reported (and profiled)."""
import json, sys, time, cProfile, pstats, torch
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft
torch.set_num_threads(2)
kern = sys.argv[1]; policy = sys.argv[2]; n = int(sys.argv[3]); mpt = int(sys.argv[4]) if len(sys.argv) > 4 else 512
target, tok = load_default_target()
draft = load_draft(target)[0] if policy != "none" else None
prompts = [json.loads(l)["prompt"] for l in open("examples/default_drafts/heldout_own.jsonl")]
prompts = (prompts * 4)[:n]
msgs = [[{"role": "user", "content": p}] for p in prompts]
def run(prof=False):
    eng = DSparkEngine(target, draft, tok, policy=None if policy == "default" else policy, max_batch_size=n, kernels=kern, max_prefill_tokens=mpt)
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    pr = cProfile.Profile() if prof else None
    t = time.perf_counter()
    if pr: pr.enable()
    outs = eng.generate(msgs, params)
    if pr: pr.disable()
    wall = time.perf_counter() - t
    m = eng.metrics
    ntok = sum(len(o.token_ids) for o in outs)
    print(f"{kern} {policy} n={n} mpt={mpt}: {ntok/wall:.1f} tok/s wall {wall:.2f} prefill {m.prefill_seconds:.2f} ({m.prefill_tokens} tok, {m.prefill_forwards} fwd) verify {m.verify_seconds:.2f} draft {m.draft_seconds:.2f} rounds {m.rounds} tau {m.tau:.2f}", flush=True)
    return pr
run()
pr = run(prof=len(sys.argv) > 5)
if pr:
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
