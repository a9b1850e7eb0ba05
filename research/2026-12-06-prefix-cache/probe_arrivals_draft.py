"""Server-like load in process, the draft's cost under load: two engines on one bf16 target, at the defaults
(the shipped draft, its policy) and without a draft, alternating in one process; C streams, 2C held-out chat
prompts, 96 tokens each, the prefix cache emptied before every run. Prints wall and CPU (process) seconds per
run and the engine's own split. Usage: [GC_FREEZE=1] [KINDS=default,none] [BUDGETS=512,1024] python probe_arrivals_draft.py C
REPEATS [profile]; GC_FREEZE=1 freezes the loaded objects out of the garbage collector first, as `dspark serve`
does"""
import cProfile, json, os, pstats, sys, time, torch
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft
torch.set_num_threads(2)
C, repeats, prof = int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3
target, tok = load_default_target(dtype=torch.bfloat16)
draft = load_draft(target)[0]
prompts = [json.loads(l)["prompt"] for l in open("examples/default_drafts/heldout_own.jsonl")]
msgs = [[{"role": "user", "content": p}] for p in (prompts * 4)[: 2 * C]]
budgets = [int(b) for b in os.environ.get("BUDGETS", "512").split(",")]  # max_prefill_tokens per engine
kinds = os.environ.get("KINDS", "default,none").split(",")
engines = {f"{k}@{b}": DSparkEngine(target, draft if k == "default" else None, tok, max_batch_size=C, max_prefill_tokens=b) for k in kinds for b in budgets}
if os.environ.get("GC_FREEZE"):
    import gc
    gc.collect(); gc.freeze()
params = SamplingParams(max_new_tokens=96, ignore_eos=True)
def run(eng):
    eng.reset_prefix_cache()
    eng.metrics.reset()
    pending = list(msgs); live = 0
    t, c = time.perf_counter(), time.process_time()
    while pending and live < C:
        eng.add_request(pending.pop(0), params); live += 1
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.finished:
                live -= 1
                if pending:
                    eng.add_request(pending.pop(0), params); live += 1
    return time.perf_counter() - t, time.process_time() - c
for eng in engines.values():
    run(eng)
profiles = {k: cProfile.Profile() for k in engines} if prof else {}
for r in range(repeats):
    for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
        eng = engines[name]
        if prof: profiles[name].enable()
        wall, cpu = run(eng)
        if prof: profiles[name].disable()
        m = eng.metrics
        print(f"{name:12s} C={C}: {len(msgs) * 96 / wall:.1f} tok/s wall {wall:.2f} s cpu {cpu:.2f} s | prefill {m.prefill_seconds:.2f} verify {m.verify_seconds:.2f} draft {m.draft_seconds:.2f} rounds {m.rounds} drafting {m.drafting_rounds} lookup {m.lookup_rounds}", flush=True)
for name, p in profiles.items():
    print("=====", name)
    pstats.Stats(p).sort_stats("tottime").print_stats(18)
