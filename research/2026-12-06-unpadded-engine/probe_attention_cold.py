"""attention_segments over 32 rows x 230 keys: 30 layers' KV buffers in turn (cold caches) vs one buffer 30 times."""
import time, torch
from dspark_hf.kernels.build import backend
torch.set_num_threads(2)
c = backend()
S, ctx, cap = 32, 230, 512
bufs = [(torch.randn(S, 3, cap, 64), torch.randn(S, 3, cap, 64)) for _ in range(30)]
q = torch.randn(1, 9, S, 64)
slots, pasts, lens = list(range(S)), [ctx - 1] * S, [1] * S
def run():
    for k, v in bufs: c.attention_segments(q, k, v, slots, pasts, lens, 0.125)
run(); t = time.perf_counter(); run(); run(); dt = (time.perf_counter() - t) / 2
print(f"cold 30 layers: {dt*1000:.1f} ms, {S*ctx*9*30/dt/1e6:.0f} Mpairs/s, {S*ctx*3*64*4*2*30/dt/1e9:.1f} GB/s")
k, v = bufs[0]
t = time.perf_counter()
for _ in range(30): c.attention_segments(q, k, v, slots, pasts, lens, 0.125)
dt = time.perf_counter() - t
print(f"hot 30 calls: {dt*1000:.1f} ms, {S*ctx*9*30/dt/1e6:.0f} Mpairs/s")
