"""The exact bf16 GEMM at 32 rows for each SmolLM2-135M linear shape, hot. Usage: python research/2026-12-06-prefix-cache/probe_gemm_shapes.py"""
import time, torch
from dspark_hf.kernels.build import backend
c = backend(); torch.set_num_threads(2)
def tm(f, n=200):
    for _ in range(5): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n
for M in (32,):
    for (N, K) in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        x = torch.randn(M, K); w = torch.randn(N, K)
        s = tm(lambda: c.linear_bf16(x, w, None), 20 if N > 10000 else 200)
        print(f"M={M} N={N} K={K}: {s*1e3:.3f} ms {2*M*N*K/s/1e9:.0f} GF/s")
