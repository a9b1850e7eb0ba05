"""Where a decoding step's time goes, on the exact-bf16 stack (SmolLM2-135M-Instruct, bf16): one forward of R
decoding rows at CONTEXT keys (`varlen_target_forward`), its linears alone (`linear_bf16` at the same shapes), its
LM head and its attention alone (`attention_segments`); then the same step with a prefill chunk of CHUNK new tokens
(a fresh prompt) riding along. Each the best of several repeats. Usage: python probe_step_split.py [R] [CONTEXT]
[CHUNK] [prof]"""
import sys, time, torch
from dspark_hf.default_model import load_default_target
from dspark_hf.kernels import use_kernels
from dspark_hf.kernels.build import backend
from dspark_hf.kernels.lean_model import varlen_stack
from dspark_hf.decoding.caches import SlotKV
from dspark_hf.decoding.target_forward import varlen_target_forward
torch.set_num_threads(2); torch.set_grad_enabled(False)
R = int(sys.argv[1]) if len(sys.argv) > 1 else 32
P = int(sys.argv[2]) if len(sys.argv) > 2 else 200
T = int(sys.argv[3]) if len(sys.argv) > 3 else 480
c = backend()
target, tok = load_default_target(dtype=torch.bfloat16)
def best(f, n=8):
    f(); b = 1e9
    for _ in range(n):
        t = time.perf_counter(); f(); b = min(b, time.perf_counter() - t)
    return b
with use_kernels(target, mode="exact-bf16"):
    stack = varlen_stack(target, [])
    store = SlotKV(R + 1)
    for r in range(R + 1): store.add(r)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (P,), generator=g).tolist() for _ in range(R)]
    # fill each slot with its prompt (one chunk per row), then time one-token decoding steps at that context
    for r in range(R):
        varlen_target_forward(target, stack, store, [r], [prompts[r]], [[P - 1]])
        store.lengths[r] += P
    toks = [[1] for _ in range(R)]
    keep = [[0] for _ in range(R)]
    step = best(lambda: varlen_target_forward(target, stack, store, list(range(R)), toks, keep))
    W, I, V, L = 576, 1536, 49152, 30
    ws = [(torch.randn(W + 2 * 192, W), torch.randn(W, W), torch.randn(2 * I, W), torch.randn(W, I)) for _ in range(L)]
    x, xi = torch.randn(R, W), torch.randn(R, I)
    def linears():
        for wqkv, wo, wgu, wd in ws:
            c.linear_bf16(x, wqkv, None); c.linear_bf16(x, wo, None); c.linear_bf16(x, wgu, None); c.linear_bf16(xi, wd, None)
    lin = best(linears)
    lm = torch.randn(V, W)
    head = best(lambda: c.linear_bf16(x, lm, None))
    bufs = [(torch.randn(R, 3, P + 16, 64).to(torch.bfloat16), torch.randn(R, 3, P + 16, 64).to(torch.bfloat16)) for _ in range(L)]
    q = torch.randn(1, 9, R, 64)
    att = best(lambda: [c.attention_segments(q, k, v, list(range(R)), [P] * R, [1] * R, 0.125) for k, v in bufs])
    print(f"R={R} context {P}: forward {step*1e3:.2f} ms | 30 layers' linears {lin*1e3:.2f} ms, LM head {head*1e3:.2f} ms, "
          f"attention {att*1e3:.2f} ms, rest {(step-lin-head-att)*1e3:.2f} ms")
    chunk = torch.randint(0, 49152, (T,), generator=g).tolist()
    mixed = best(lambda: varlen_target_forward(target, stack, store, list(range(R + 1)), toks + [chunk], keep + [[T - 1]]))
    print(f"with a {T}-token prefill chunk riding along: {mixed*1e3:.2f} ms")
    if len(sys.argv) > 4:
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for _ in range(20): varlen_target_forward(target, stack, store, list(range(R)), toks, keep)
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
