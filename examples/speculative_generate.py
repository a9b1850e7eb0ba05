"""The base example: speculative generate() with a DSpark draft on the default target, checked against plain generate().

    python examples/speculative_generate.py [--draft PATH] [--prompt TEXT] [--max-new-tokens 48]

Without `--draft` the shipped DSpark draft for the default target is used (`--draft fresh`: an untrained one).
Output is exactly the target's either way.
"""

from __future__ import annotations

import argparse

import torch

import dspark_hf  # noqa: F401  (registers the generate() hook)
from dspark_hf import last_generation_stats
from dspark_hf.default_model import chat_inputs, load_default_target, load_draft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", default=None)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    target, tokenizer = load_default_target()
    draft, _ = load_draft(target, args.draft)  # the shipped DSpark draft without --draft
    inputs = chat_inputs(tokenizer, args.prompt)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    plain = target.generate(**inputs, **kwargs)
    spec = target.generate(**inputs, assistant_model=draft, dspark_policy="fixed", **kwargs)
    assert torch.equal(plain, spec), "speculative output must equal plain generate()"

    stats = last_generation_stats(draft)
    print(tokenizer.decode(spec[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    print(f"identical to plain generate(): yes; tau = {stats.tau:.2f} over {stats.num_rounds} rounds")
    print("time split (s):", {k: round(v, 3) for k, v in stats.time_split().items()})


if __name__ == "__main__":
    main()
