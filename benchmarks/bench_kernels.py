"""The three kernel modes (`dspark_hf.kernels`) side by side on the default target: forward cost and exactness.

SmolLM2-135M-Instruct, fp32. For each mode (`stock`, `packed`, `exact`) and each `B` in `--tokens`:

1. `forward`: the target's forward over `B` new tokens on a `--context`-token KV cache (the verification
   shape; `B = 1` is one plain decoding step). Modes and `B` values are interleaved inside every repeat, so
   all see the same machine load; medians over `--repeats`.
2. `rows_identical`: whether every row of the `B`-token forward's logits is bit-identical (`torch.equal`) to
   the same token decoded alone, one at a time, on the same cache (only the exact mode promises this).
3. `decode`: plain greedy `generate()` tokens/s per mode on three chat prompts (`--decode-tokens` new tokens).

Usage:
    python benchmarks/bench_kernels.py [--repeats 7] [--threads 2] [--out docs/results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_hf.default_model import chat_inputs, load_default_target
from dspark_hf.kernels import KERNEL_MODES, exact_kernels_backend, use_kernels

PROMPTS = ["Explain why the sky is blue.", "Write a Python function that reverses a string.", "What is 17 times 23?"]


@torch.no_grad()
def _prefilled(target, prompt: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    target(prompt, cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def rows_identical(target, prompt: torch.Tensor, new: torch.Tensor) -> int:
    """How many rows of one forward over `new` equal decoding `new` token by token (bit for bit)."""
    block = target(new, cache=_prefilled(target, prompt), use_cache=True).logits[0]
    cache = _prefilled(target, prompt)
    steps = [target(new[:, i : i + 1], cache=cache, use_cache=True).logits[0, 0] for i in range(new.shape[1])]
    return sum(torch.equal(block[i], steps[i]) for i in range(new.shape[1]))


@torch.no_grad()
def bench_forward(target, tokens: list[int], context: int, repeats: int) -> dict:
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    caches = {}
    samples = {mode: {b: [] for b in tokens} for mode in KERNEL_MODES}
    new = {b: torch.randint(0, vocab, (1, b), generator=gen) for b in tokens}
    identical = {}
    for mode in KERNEL_MODES:
        with use_kernels(target, mode=mode):
            caches[mode] = _prefilled(target, prompt)
            identical[mode] = {b: rows_identical(target, prompt, new[b]) for b in tokens if b > 1}
    for _ in range(repeats + 1):  # the first round warms up (allocations, packing, kernel build)
        for mode in KERNEL_MODES:
            with use_kernels(target, mode=mode):
                cache = caches[mode]
                for b in tokens:
                    positions = torch.arange(context, context + b)[None]
                    start = time.perf_counter()
                    target(new[b], position_ids=positions, cache=cache, use_cache=True)
                    samples[mode][b].append(time.perf_counter() - start)
                    cache.crop(-b)  # back to the shared context
    out = {}
    for mode in KERNEL_MODES:
        med = {b: statistics.median(samples[mode][b][1:]) for b in tokens}
        out[mode] = {
            "ms": {b: round(med[b] * 1e3, 2) for b in tokens},
            "rel_own_B1": {b: round(med[b] / med[tokens[0]], 3) for b in tokens},
            "rel_stock_B1": None,
            "rows_identical": {b: f"{identical[mode][b]}/{b}" for b in identical[mode]},
        }
    stock_b1 = out["stock"]["ms"][tokens[0]]
    for mode in KERNEL_MODES:
        out[mode]["rel_stock_B1"] = {b: round(out[mode]["ms"][b] / stock_b1, 3) for b in tokens}
    return out


@torch.no_grad()
def bench_decode(target, tokenizer, new_tokens: int, repeats: int) -> dict:
    inputs = [chat_inputs(tokenizer, p, target.device) for p in PROMPTS]
    kw = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    samples = {mode: [] for mode in KERNEL_MODES}
    outputs = {}
    for r in range(repeats + 1):
        for mode in KERNEL_MODES:
            count, start = 0, time.perf_counter()
            outs = [target.generate(**x, **kw, dspark_kernels=mode) for x in inputs]
            elapsed = time.perf_counter() - start
            count = sum(o.shape[1] - x["input_ids"].shape[1] for o, x in zip(outs, inputs))
            outputs[mode] = outs
            if r > 0:
                samples[mode].append(count / elapsed)
    res = {mode: {"tokens_per_s": round(statistics.median(samples[mode]), 2)} for mode in KERNEL_MODES}
    for mode in KERNEL_MODES:
        res[mode]["same_tokens_as_stock"] = all(
            torch.equal(a, b) for a, b in zip(outputs[mode], outputs["stock"], strict=True)
        )
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32, help="0 skips the decoding measurement")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    result = {
        "command": "python " + shlex.join(sys.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "torch": torch.__version__,
        "exact_backend": exact_kernels_backend(),
        "context": args.context,
        "repeats": args.repeats,
        "forward": bench_forward(target, args.tokens, args.context, args.repeats),
    }
    if args.decode_tokens:
        result["decode"] = bench_decode(target, tokenizer, args.decode_tokens, args.decode_repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
