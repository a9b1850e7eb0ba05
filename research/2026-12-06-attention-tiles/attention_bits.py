"""Bit-for-bit record of the exact attention on random inputs (both entry points, float32 and bf16 keys and
values, head dims 64 and 128, causal and masked, decoding and prefill shapes): `save FILE` with one build, `check
FILE` with another. A kernel change that keeps every query's operations must pass `check` with zero differences."""
import sys, torch
from dspark_hf.kernels.build import backend
c = backend(); torch.set_num_threads(2)
def cases():
    g = torch.Generator().manual_seed(0)
    for D in (64, 128):
        for kv in (torch.float32, torch.bfloat16):
            for (B, Lq, Lk) in ((1, 1, 1), (3, 1, 37), (2, 7, 7), (1, 33, 90), (2, 130, 300)):
                q = torch.randn(B, 9, Lq, D, generator=g) * 3
                k = (torch.randn(B, 3, Lk, D, generator=g) * 3).to(kv); v = torch.randn(B, 3, Lk, D, generator=g).to(kv)
                yield f"attn D{D} {kv} {B}x{Lq}x{Lk} causal", c.attention(q, k, v, torch.empty(0, dtype=torch.bool), 0.125)
                m = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
                m[..., 0] = True
                yield f"attn D{D} {kv} {B}x{Lq}x{Lk} masked", c.attention(q, k, v, m, 0.125)
            S, cap = 5, 400
            kb = (torch.randn(S, 3, cap, D, generator=g) * 3).to(kv); vb = torch.randn(S, 3, cap, D, generator=g).to(kv)
            for lens, pasts in (([1] * 5, [0, 5, 17, 100, 299]), ([1, 9, 1, 130, 4], [12, 0, 250, 40, 3])):
                q = torch.randn(1, 9, sum(lens), D, generator=g) * 3
                yield f"seg D{D} {kv} {lens} {pasts}", c.attention_segments(q, kb, vb, [4, 0, 2, 1, 3], pasts, lens, 0.125)
mode, path = sys.argv[1], sys.argv[2]
got = dict(cases())
if mode == "save":
    torch.save(got, path); print(len(got), "cases saved")
else:
    ref = torch.load(path); bad = 0
    for name, t in got.items():
        same = torch.equal(t.view(torch.int32), ref[name].view(torch.int32))
        bad += not same
        if not same: print("DIFFERENT", name, (t.view(torch.int32) != ref[name].view(torch.int32)).sum().item())
    print(f"{len(got) - bad} of {len(got)} cases bit-identical")
