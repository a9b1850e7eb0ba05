"""What chunked prefill does to the engine's rounds when long prompts arrive while others decode.

On the real default target (SmolLM2-135M-Instruct, fp32, offline), without speculation: 4 requests are decoding
when 4 prompts of `--prompt-tokens` tokens arrive; for each `max_prefill_tokens` budget, every round is timed
until all long prompts have their first token. A budget above the prompts' total prefills them in one round,
during which the decoding requests get nothing; a smaller one spreads them over rounds that each also decode.

    python benchmarks/bench_chunked_prefill.py --budgets 512 100000 --kernels exact
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target


def run(target, tokenizer, budget: int, kernels: str, prompt_tokens: int) -> dict:
    text = " ".join(f"Item {i}: the value of item {i} is {i * 7 % 13}." for i in range(2000))
    ids = tokenizer(text)["input_ids"]
    longs = [ids[i * 50 : i * 50 + prompt_tokens] for i in range(4)]
    engine = DSparkEngine(
        target, None, tokenizer, policy="none", max_batch_size=8, kernels=kernels, max_prefill_tokens=budget
    )
    engine.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(max_new_tokens=2))  # warm-up
    for n in range(4):
        chat = [{"role": "user", "content": f"Count to {n + 10}."}]
        engine.add_request(chat, SamplingParams(max_new_tokens=400, ignore_eos=True))
    for _ in range(3):
        engine.step()
    long_ids = {engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in longs}
    rounds, first, start = [], {}, time.perf_counter()
    while len(first) < len(long_ids):
        t = time.perf_counter()
        events = engine.step()
        rounds.append(time.perf_counter() - t)
        for ev in events:
            if ev.request_id in long_ids and ev.token_ids:
                first.setdefault(ev.request_id, time.perf_counter() - start)
    engine.release_kernels()
    return {
        "rounds": len(rounds),
        "longest_round_s": max(rounds),
        "median_round_s": statistics.median(rounds),
        "first_tokens_s": sorted(first.values()),
        "prefill_chunks": engine.metrics.prefill_chunks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 100000])
    parser.add_argument("--kernels", default="exact")
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    for budget in args.budgets:
        r = run(target, tokenizer, budget, args.kernels, args.prompt_tokens)
        print(
            f"max_prefill_tokens {budget}: {r['rounds']} rounds until every long prompt's first token, longest "
            f"{r['longest_round_s']:.2f} s, median {r['median_round_s']:.2f} s; first tokens at "
            f"{', '.join(f'{s:.1f}' for s in r['first_tokens_s'])} s; {r['prefill_chunks']} chunks"
        )


if __name__ == "__main__":
    main()
