"""linear_bf16 / linear (the exact GEMMs) at M = 32 and 512 rows, K = 576, N = 48 .. 1536: the per-call cost that
does not scale with N. Usage: python research/2026-12-06-bf16-kv/probe_gemm_fixed_cost.py"""
import torch, time
from dspark_hf.kernels.build import backend
c = backend(); torch.set_num_threads(2)
def tm(f, n=50):
    f(); t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1000
for M in (32, 512):
    for N in (48, 96, 576, 1536):
        x = torch.randn(M, 576); w = torch.randn(N, 576)
        print(M, N, "bf16 %.3f ms" % tm(lambda: c.linear_bf16(x, w, None)), "fp32 %.3f ms" % tm(lambda: c.linear(x, w, None)))
