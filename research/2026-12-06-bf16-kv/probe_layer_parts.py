"""One SmolLM2-135M-shaped decoder layer (random weights) on the exact-bf16 calls: attn_in_bf16, the attention,
attn_out_bf16 and each linear alone, at T rows (env T, default 512). Usage, from the repository root:
T=512 python research/2026-12-06-bf16-kv/probe_layer_parts.py"""
import torch, time, sys
sys.path.insert(0, "tests/kernels")  # the layer helpers of test_exact_gemm_bf16
from test_exact_gemm_bf16 import _layer, _rope_tables, _attn_in, _attn_out, _compiled
torch.set_num_threads(2)
c = _compiled()
L = _layer(W=576, hq=9, hkv=3, D=64, inter=1536)
import os; T = int(os.environ.get("T", 512))
x = torch.randn(T, 576)
cos, sin = _rope_tables(T, 64)
def tm(f, n=20):
    f(); t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1000
q, k, v = _attn_in("attn_in_bf16", L, x, cos, sin)
print("attn_in_bf16 %.2f ms" % tm(lambda: _attn_in("attn_in_bf16", L, x, cos, sin)))
print("attention %.2f ms" % tm(lambda: c.attention(q, k, v, torch.empty(0, dtype=torch.bool), 0.125)))
print("attn_out_bf16 %.2f ms" % tm(lambda: _attn_out("attn_out_bf16", L, x, q, k, v)))
h = c.rms_norm(x, L["ln_in"], 1e-5)
print("rms_norm %.3f ms" % tm(lambda: c.rms_norm(x, L["ln_in"], 1e-5)))
from dspark_hf.kernels import exact_linear
for nm, w in (("q", L["wq"]), ("k", L["wk"]), ("o", L["wo"]), ("g", L["wg"]), ("d", L["wd"])):
    xin = torch.randn(T, w.shape[1])
    ms = tm(lambda: exact_linear(xin, w, None, bf16=True))
    print(f"linear {nm} {tuple(w.shape)} {ms:.3f} ms {2*T*w.numel()/ms/1e6:.0f} GF/s")
g = torch.randn(T, 1536); u = torch.randn(T, 1536)
print("silu_mul %.3f ms" % tm(lambda: c.silu_mul(g, u)))
qq = torch.randn(1, T, 576)
print("rope q %.3f ms" % tm(lambda: c.rope(qq, cos, sin, 9)))
