"""The exact attention of a 512-token prefill chunk (one sequence, causal, SmolLM2's heads) over bf16 keys and
values in a slot, per layer; and of a 32-row decoding step at 230 keys (30 layers, cold). Usage:
python research/2026-12-06-prefix-cache/probe_prefill_attention.py"""
import time, torch
from dspark_hf.kernels.build import backend
c = backend(); torch.set_num_threads(2)
Hq, Hkv, D = 9, 3, 64
def best(f, n=10):
    f(); b = 1e9
    for _ in range(n):
        t = time.perf_counter(); f(); b = min(b, time.perf_counter() - t)
    return b
for past, T in ((0, 512), (512, 512)):
    kb = torch.randn(1, Hkv, past + T, D).to(torch.bfloat16); vb = torch.randn(1, Hkv, past + T, D).to(torch.bfloat16)
    q = torch.randn(1, Hq, T, D)
    s = best(lambda: c.attention_segments(q, kb, vb, [0], [past], [T], 0.125))
    print(f"prefill chunk of {T} after {past}: {s*1e3:.2f} ms per layer", flush=True)
R, P, L = 32, 230, 30
bufs = [(torch.randn(R, Hkv, P + 16, D).to(torch.bfloat16), torch.randn(R, Hkv, P + 16, D).to(torch.bfloat16)) for _ in range(L)]
q = torch.randn(1, Hq, R, D)
s = best(lambda: [c.attention_segments(q, k, v, list(range(R)), [P - 1] * R, [1] * R, 0.125) for k, v in bufs], 5)
print(f"decoding step, 32 rows x 230 keys, 30 layers: {s*1e3:.2f} ms", flush=True)
