import sys, time, torch
torch.set_num_threads(1)
import dspark_hf
from dspark_hf.default_model import load_default_target, load_draft, chat_inputs
from dspark_hf.evaluation.prompt_sets import load_prompt_set
try:
    from dspark_hf import last_generation_stats
    stats_of = last_generation_stats
except ImportError:
    stats_of = lambda d: d.last_generation_stats
target, tok = load_default_target()
draft, _ = load_draft(target)
items = load_prompt_set(sys.argv[1], limit=int(sys.argv[2]))
toks = rounds = 0; t = 0
for it in items:
    inp = chat_inputs(tok, it.prompt)
    s = time.perf_counter()
    out = target.generate(**inp, assistant_model=draft, max_new_tokens=96, do_sample=False, pad_token_id=tok.eos_token_id)
    t += time.perf_counter() - s
    st = stats_of(draft)
    rounds += st.num_rounds; toks += st.tau * st.num_rounds
    look = getattr(st, "lookup_rounds", None); miss = getattr(st, "lookup_misses", None)
    print(f"[{look},{miss}]", end="")
    print(round(st.tau, 2), end=" ", flush=True)
print(f"\n{sys.argv[3]}: tokens {toks} rounds {rounds} tau {toks/max(rounds,1):.2f} seconds {t:.1f}")
