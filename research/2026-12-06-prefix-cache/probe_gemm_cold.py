"""linear_bf16 with its weights cold (cycling through 48 SmolLM2-sized gate/up weights, 85 MB of bf16 panels, more
than the caches hold, as a decoding step streams all its weights) and hot (one weight again and again), M = 8 .. 256
rows, K = 576, N = 1536. Usage: python research/2026-12-06-prefix-cache/probe_gemm_cold.py"""
import time, torch
from dspark_hf.kernels.build import backend
c = backend(); torch.set_num_threads(2)
K, N, W = 576, 1536, 48
ws = [torch.randn(N, K) for _ in range(W)]
for M in (8, 16, 32, 64, 128, 256):
    x = torch.randn(M, K)
    for w in ws: c.linear_bf16(x, w, None)  # packed once (cached)
    res = {}
    for name, seq in (("cold", ws), ("hot", [ws[0]] * W)):
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for w in seq: c.linear_bf16(x, w, None)
            best = min(best, (time.perf_counter() - t) / W)
        res[name] = best
    gf = lambda s: 2 * M * K * N / s / 1e9
    print(f"M={M:4d} cold {res['cold']*1e3:.3f} ms {gf(res['cold']):5.0f} GF/s  hot {res['hot']*1e3:.3f} ms {gf(res['hot']):5.0f} GF/s  weight GB/s cold {N*K*2/res['cold']/1e9:.1f}", flush=True)
