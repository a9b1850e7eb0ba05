"""The exact attention kernel alone: decoding (32 rows x 1 query) and prefill (512 queries) shapes of SmolLM2-135M."""
import time, torch
from dspark_hf.kernels.build import backend
torch.set_num_threads(2)
c = backend()
print([n for n in dir(c) if not n.startswith("_")])
def t(f, n=5):
    f(); s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1000
for B, Lq, Lk in [(32,1,700),(32,1,1300),(1,512,512),(1,512,1024)]:
    q = torch.randn(B,9,Lq,64); k = torch.randn(B,3,Lk,64); v = torch.randn(B,3,Lk,64)
    ms = t(lambda: c.attention(q,k,v,torch.empty(0,dtype=torch.bool),0.125))
    pairs = B*9*Lq*(Lk if Lq==1 else (Lk - Lq/2))
    print(B,Lq,Lk, f"{ms:.2f} ms  {pairs/ms/1e3:.0f} Mpairs/s  x30 layers {ms*30:.0f} ms")
x = torch.randn(32,576); w = torch.randn(1536,576)
for rows in (32, 512):
    x = torch.randn(rows,576)
    ms = t(lambda: c.linear_bf16(x,w,None) if hasattr(c,'linear_bf16') else None)
    print("linear_bf16", rows, f"{ms:.3f} ms {2*rows*576*1536/ms/1e6:.0f} GFLOP/s")
# correctness vs sdpa
import torch.nn.functional as F
q = torch.randn(2,9,7,64); k = torch.randn(2,3,40,64); v = torch.randn(2,3,40,64)
o = c.attention(q,k,v,torch.empty(0,dtype=torch.bool),0.125)
ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3,1), v.repeat_interleave(3,1), attn_mask=torch.ones(7,40,dtype=torch.bool).tril(33), scale=0.125).transpose(1,2)
print("max err", (o-ref).abs().max().item())
