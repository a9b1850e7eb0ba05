"""The exact attention of one decoding step at 32 rows (one query position per row, SmolLM2's 9 query and 3
key/value heads of 64), bf16 keys and values, P keys per row: hot (one layer's buffers again and again) and cold
(cycling through 30 layers' buffers, as a step streams every layer's cache). Usage:
python research/2026-12-06-prefix-cache/probe_decode_attention.py [P ...]"""
import sys, time, torch
from dspark_hf.kernels.build import backend
c = backend(); torch.set_num_threads(2)
R, Hq, Hkv, D, L = 32, 9, 3, 64, 30
for P in [int(a) for a in sys.argv[1:]] or [8, 230, 600]:
    cap = P + 16
    bufs = [(torch.randn(R, Hkv, cap, D).to(torch.bfloat16), torch.randn(R, Hkv, cap, D).to(torch.bfloat16)) for _ in range(L)]
    q = torch.randn(1, Hq, R, D)
    slots, pasts, lens = list(range(R)), [P - 1] * R, [1] * R
    f = lambda kv: c.attention_segments(q, kv[0], kv[1], slots, pasts, lens, 0.125)
    for kv in bufs: f(kv)
    res = {}
    for name, seq in (("cold", bufs), ("hot", [bufs[0]] * L)):
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for kv in seq: f(kv)
            best = min(best, time.perf_counter() - t)
        res[name] = best
    gb = R * Hkv * P * D * 2 * 2 * L / 1e9
    print(f"P={P}: a step's 30 layers cold {res['cold']*1e3:.2f} ms ({gb/res['cold']:.1f} GB/s of K/V), hot {res['hot']*1e3:.2f} ms", flush=True)
