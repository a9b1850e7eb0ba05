"""How many rows the engine's prefill forwards computed against the prompts' tokens (the padding), 32 prompts."""
import json, sys, torch
import dspark_hf.decoding.engine as E
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target
target, tok = load_default_target()
rec = []
orig = E.ragged_target_forward
def wrap(t, kvs, chunks, *a, **k):
    rec.append((len(chunks), max(map(len, chunks)), sum(map(len, chunks))))
    return orig(t, kvs, chunks, *a, **k)
E.ragged_target_forward = wrap
prompts = [json.loads(l)["prompt"] for l in open("examples/default_drafts/heldout_own.jsonl")]
n = int(sys.argv[1]); prompts = (prompts * 4)[:n]
msgs = [[{"role": "user", "content": p}] for p in prompts]
eng = DSparkEngine(target, None, tok, max_batch_size=n, kernels="exact-bf16")
eng.generate(msgs, SamplingParams(max_new_tokens=2, ignore_eos=True))
tot = sum(r*w for r, w, _ in rec); real = sum(s for *_, s in rec)
print(rec); print("computed", tot, "real", real, "waste", 1 - real/tot)
