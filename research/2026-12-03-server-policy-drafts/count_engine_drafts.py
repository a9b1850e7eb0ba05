"""Where the engine's default policy drafts under server-like traffic: drafting rounds per batch size.

The default pair in one `DSparkEngine` (exact kernels, greedy, `max_batch_size` 32 as `bench_serve.py` runs
the server), fed like one `bench_serve.py` level: C requests in flight, a new one admitted as soon as one
finishes, the 16 prompts of that benchmark × `--max-tokens` each, `--passes` times over with the same engine
(a server keeps its policy state across levels). Prints after every pass the rounds and the drafting rounds
per batch size, and at the end the payoff guard's state per batch size (drafting and plain tokens/s, the probe
wait). Speed is not measured here (one engine, no baseline); `bench_serve.py` measures it.

    python research/2026-12-03-server-policy-drafts/count_engine_drafts.py --concurrency 4 --passes 10
    python research/2026-12-03-server-policy-drafts/count_engine_drafts.py --set plain_smoothing=0.25 guard_margin=0 inherit_veto=false  # before 12-03
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.default_model import load_default_target, load_draft

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained server benchmark's prompts
from bench_serve import PROMPTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="override policy attributes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    engine = DSparkEngine(target, load_draft(target)[0], tokenizer, max_batch_size=32, kernels="exact")
    policy = engine.policy
    for item in args.set:
        name, _, value = item.partition("=")
        old = getattr(policy, name)  # an unknown name fails here
        setattr(policy, name, value.lower() in ("1", "true", "yes") if isinstance(old, bool) else type(old)(value))
    print(f"policy: {policy!r}", flush=True)
    rounds, drafted = collections.Counter(), collections.Counter()
    plan = policy.plan_length

    def counting_plan(rows, gamma, context):
        length = plan(rows, gamma, context)
        rounds[rows] += 1
        drafted[rows] += bool(length)
        return length

    policy.plan_length = counting_plan
    params = SamplingParams(max_new_tokens=args.max_tokens)
    for n in range(args.passes):
        waiting = [[{"role": "user", "content": p}] for p in PROMPTS]
        in_flight = 0
        while waiting or engine.has_unfinished():
            while waiting and in_flight < args.concurrency:
                engine.add_request(waiting.pop(0), params)
                in_flight += 1
            in_flight -= sum(event.finished for event in engine.step())
        print(f"pass {n}: rounds {dict(sorted(rounds.items()))}, drafting {dict(sorted(drafted.items()))}", flush=True)
    context = engine.schedule_context
    for rows, state in sorted(context.payoff.items()):
        print(
            f"batch {rows}: {state.drafts} drafting rounds, drafting {state.draft_rate:.1f} tok/s vs plain "
            f"{state.plain_rate:.1f} tok/s, probe wait {context.probe_wait.get(rows, '-')}"
        )


if __name__ == "__main__":
    main()
