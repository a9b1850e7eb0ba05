"""One unpadded target forward of 32 decoding rows at contexts 8 / 230 / 600, and a 512-token prefill.
Usage: python probe_decode_forward.py exact|exact-bf16 (bf16: the target held in bfloat16)."""
import time, torch, sys
from dspark_hf.default_model import load_default_target
from dspark_hf.kernels import use_kernels
from dspark_hf.kernels.lean_model import varlen_stack
from dspark_hf.decoding.caches import SlotKV
from dspark_hf.decoding.target_forward import varlen_target_forward
torch.set_num_threads(2)
mode = sys.argv[1]
target, tok = load_default_target(dtype=torch.bfloat16 if mode == "exact-bf16" else None)
with use_kernels(target, mode=mode), torch.no_grad():
    stack = varlen_stack(target, None)
    for ctx in (8, 230, 600):
        store = SlotKV(32)
        for i in range(32): store.add(i)
        # fill each slot with ctx tokens via one prefill per slot group
        varlen_target_forward(target, stack, store, list(range(32)), [[5] * ctx] * 32, [[ctx - 1]] * 32)
        for s in range(32): store.lengths[s] = ctx
        rows = [[7]] * 32
        def f():
            varlen_target_forward(target, stack, store, list(range(32)), rows, [[0]] * 32)
        f(); n = 10; t = time.perf_counter()
        for _ in range(n): f()
        print(mode, "ctx", ctx, f"{(time.perf_counter()-t)/n*1000:.1f} ms per 32-row decode forward")
    rows = [[7] * 512]
    store = SlotKV(1); store.add(0)
    def g():
        store.lengths[0] = 0
        varlen_target_forward(target, stack, store, [0], rows, [[511]])
    g(); t = time.perf_counter(); g(); g(); print(mode, f"512-token prefill {(time.perf_counter()-t)/2*1000:.0f} ms")
