"""τ of speculative `generate()` with the shipped draft at its defaults, on the first N prompts of an evaluation set.

    python tau.py gsm8k 8 after                          # the current checkout
    PYTHONPATH=<before>/src python tau.py gsm8k 8 before   # an older tree (it reads stats off the draft)

Greedy, 96 new tokens, one thread. Prints each prompt's `[copy rounds, lookup misses]` and τ, then the pooled τ.
"""

import sys
import time

import torch

import dspark_hf  # noqa: F401  (registers the generate() hook)
from dspark_hf.default_model import chat_inputs, load_default_target, load_draft
from dspark_hf.evaluation.prompt_sets import load_prompt_set


def stats_of(draft):
    try:
        from dspark_hf import last_generation_stats
    except ImportError:  # before the redesign the stats sat on the draft
        return draft.last_generation_stats
    return last_generation_stats(draft)


def main() -> None:
    set_name, limit, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    target, tokenizer = load_default_target()
    draft, _ = load_draft(target)
    tokens = rounds = seconds = 0.0
    for item in load_prompt_set(set_name, limit=limit):
        inputs = chat_inputs(tokenizer, item.prompt)
        start = time.perf_counter()
        target.generate(
            **inputs, assistant_model=draft, max_new_tokens=96, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        seconds += time.perf_counter() - start
        stats = stats_of(draft)
        rounds += stats.num_rounds
        tokens += stats.tau * stats.num_rounds
        copies, misses = getattr(stats, "lookup_rounds", None), getattr(stats, "lookup_misses", None)
        print(f"[{copies},{misses}]{stats.tau:.2f}", end=" ", flush=True)
    print(f"\n{tag}: tokens {tokens:.0f} rounds {rounds:.0f} tau {tokens / max(rounds, 1):.2f} seconds {seconds:.1f}")


if __name__ == "__main__":
    main()
