"""The system's efficiency, independent of the draft's quality: speculation with an oracle proposer.

The oracle proposes the target's own greedy continuation, cut so that each round accepts a set number of tokens
(Bresenham's schedule: `m_k = ⌊(k+1)(τ-1)⌋ - ⌊k(τ-1)⌋` right tokens, then wrong ones, so rounds emit `τ` tokens on
average), verifying `ℓ = max(1, ⌈τ - 1⌉)` tokens a round. It is plugged into the [`Speculator`] as just another
proposer (the `backends=` of `dspark_hf.decoding.speculator.Speculator`), so every other part of the round (the
engine, verification, acceptance, the kernels) is the one users run. For each `τ` the table holds:

* the measured speedup of the decoding phase: plain decoding's wall time over the oracle's, the same prompts on the
  same kernels, interleaved, each less its prefill (the engine's `prefill_seconds`: the same forward in both runs,
  which the ideal below does not count either);
* the ideal speedup from measured forward costs, `τ · T(1) / (T(ℓ+1) + T_draft)`: `T(1)` the target's forward in
  a plain round, `T(ℓ+1)` its forward in an oracle round (each the mean wall time of the engine's one target
  forward call, timed around it: no acceptance, KV bookkeeping or emission inside), `T_draft` the oracle round's
  proposing (the engine's `draft_seconds`);
* their ratio, the efficiency: how much of what the forward costs allow the system delivers (everything around
  the forwards, in both loops, counts against it);
* and, for the reader who wants the whole call, the end-to-end speedup (prefill included: with 96 new tokens a
  ~90-token prompt's prefill is a quarter of the oracle's time at `τ` = 6, which caps it well below the ideal).

It runs on the CPU here and, unchanged, on a GPU (`--device cuda`, e.g. with `benchmarks/run_gpu.sh`'s random-weight
Qwen3-8B-shaped bf16 target). Timings belong on a quiet machine.

Usage (from the repository root):
    python benchmarks/bench_efficiency.py [--taus 1 1.5 2 3 4 6] [--prompts 4] [--max-new-tokens 96]
        [--repeats 3] [--kernels exact] [--device cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import dspark_hf  # noqa: F401  (registers the generate() hook)
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.decoding.backends import Drafted
from dspark_hf.decoding.drafting import BlockScores, DraftedBlock

TAUS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def verified_length(tau: float) -> int:
    """`ℓ`: the fewest tokens a round verifies to reach `τ` tokens a round (at least one)."""
    return max(1, math.ceil(tau - 1 - 1e-9))


class OracleProposer:
    """Proposes the target's own greedy continuation of each row, right for `m_k` tokens then wrong (the
    backends' interface: `ingest` and `propose`, see `dspark_hf.decoding.backends`).

    Args:
        continuations (`dict[int, list[int]]`): per slot, the row's whole greedy sequence (prompt included).
        tau (`float`): tokens a round should emit on average (`≥ 1`).
        vocab_size (`int`): the target's vocabulary (a wrong token is the right one plus 1, modulo it).
    """

    name = "oracle"

    def __init__(self, continuations: dict[int, list[int]], tau: float, vocab_size: int) -> None:
        self.continuations, self.tau, self.vocab_size = continuations, tau, vocab_size
        self.committed: dict[int, int] = {}  # per slot: tokens before the anchor (their features were ingested)
        self.rounds = 0

    def ingest(self, stores, features, slots=None) -> None:
        for slot, f in zip(slots or range(len(features)), features):
            self.committed[slot] = self.committed.get(slot, 0) + f.shape[0]

    def right_tokens(self, k: int) -> int:
        """`m_k`: how many proposed tokens of round `k` are the target's own."""
        return math.floor((k + 1) * (self.tau - 1) + 1e-9) - math.floor(k * (self.tau - 1) + 1e-9)

    def propose(self, inputs) -> Drafted:
        slots = inputs.slots if inputs.slots is not None else [0]
        length = inputs.planned or verified_length(self.tau)
        right = self.right_tokens(self.rounds)
        self.rounds += 1
        rows = []
        for slot in slots:
            start = self.committed.get(slot, 0) + 1  # the anchor sits at `committed`
            truth = self.continuations[slot][start : start + length]
            truth += [0] * (length - len(truth))  # past the continuation's end: never verified (the budget)
            rows.append([t if j < right else (t + 1) % self.vocab_size for j, t in enumerate(truth)])
        tokens = torch.tensor(rows, device=inputs.anchors.device)
        ones = torch.ones(tokens.shape, device=tokens.device)
        return Drafted(DraftedBlock(tokens, None, None), BlockScores(ones, ones, ones), time.perf_counter())


def oracle_engine(target, draft, continuations: dict[int, list[int]], tau: float, kernels: str | None):
    """A batch-1 engine whose speculator proposes with an [`OracleProposer`] alone (the draft only supplies the
    block size and the target-layer ids the engine expects; it never runs). Prompt lookup is off: its copy rounds
    would emit tokens the oracle's schedule did not set, and `τ` would not be the one asked for."""
    engine = DSparkEngine(
        target, draft, policy=f"fixed:{verified_length(tau)}", max_batch_size=1, kernels=kernels, lookup=False
    )
    oracle = OracleProposer(continuations, tau, target.config.get_text_config().vocab_size)
    engine.speculator.backends = [oracle]
    return engine, oracle


def time_forwards(engine) -> list[float]:
    """Wrap the engine's one target forward per round so each call's wall time is recorded (returned list)."""
    seconds: list[float] = []
    forward = engine._target_forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    engine._target_forward = timed
    return seconds


def _timed(engine, prompt: list[int], max_new: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_new_tokens=max_new, ignore_eos=True))[0]
    return time.perf_counter() - start, out.token_ids


def measure(target, draft, prompts: list[list[int]], tau: float, max_new: int, repeats: int, kernels) -> dict:
    """Plain and oracle runs interleaved on the same prompts; the speedup, the ideal one, their ratio."""
    plain = DSparkEngine(target, None, max_batch_size=1, kernels=kernels)
    plain_forwards, oracle_forwards = time_forwards(plain), []
    times = {"plain": 0.0, "oracle": 0.0, "plain_prefill": 0.0, "oracle_prefill": 0.0}
    emitted = 0
    for _ in range(repeats):
        for prompt in prompts:
            prefill = plain.metrics.prefill_seconds
            seconds, ref = _timed(plain, prompt, max_new)
            times["plain"] += seconds
            times["plain_prefill"] += plain.metrics.prefill_seconds - prefill
            engine, oracle = oracle_engine(target, draft, {0: prompt + ref}, tau, kernels)
            forwards = time_forwards(engine)
            seconds, out = _timed(engine, prompt, max_new)
            assert out == ref, "the oracle changed the output: verification is broken"
            times["oracle"] += seconds
            emitted += len(out) - 1  # the prefill's token is not a round's
            m = engine.metrics
            times["oracle_prefill"] += m.prefill_seconds
            oracle_forwards += forwards
            times.setdefault("draft", []).append(m.draft_seconds / m.rounds)
            times.setdefault("rounds", []).append(m.rounds)
    t1 = sum(plain_forwards) / len(plain_forwards)
    t_verify = sum(oracle_forwards) / len(oracle_forwards)
    t_draft = sum(times["draft"]) / len(times["draft"])
    achieved = emitted / sum(times["rounds"])
    ideal = achieved * t1 / (t_verify + t_draft)
    end_to_end = times["plain"] / times["oracle"]
    speedup = (times["plain"] - times["plain_prefill"]) / (times["oracle"] - times["oracle_prefill"])
    return {"tau": tau, "achieved_tau": achieved, "length": verified_length(tau), "speedup": speedup,
            "ideal": ideal, "efficiency": speedup / ideal, "end_to_end": end_to_end, "T1_ms": 1e3 * t1,
            "T_verify_ms": 1e3 * t_verify, "T_draft_ms": 1e3 * t_draft}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--taus", type=float, nargs="+", default=list(TAUS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", default=None, help="the target's kernel mode (default: the library's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from dspark_hf.default_model import chat_inputs, load_default_target, load_draft
    from dspark_hf.evaluation.prompt_sets import evaluation_texts

    target, tokenizer = load_default_target()
    target = target.to(args.device)
    draft, _ = load_draft(target)
    texts = evaluation_texts()[: args.prompts]
    prompts = [chat_inputs(tokenizer, text)["input_ids"][0].tolist() for text in texts]
    # warm-up, not reported: the first calls build and pack the kernels' weights and fill the caches
    measure(target, draft, prompts[:1], args.taus[0], args.max_new_tokens, 1, args.kernels)
    rows = [measure(target, draft, prompts, tau, args.max_new_tokens, args.repeats, args.kernels) for tau in args.taus]
    print("| τ | achieved τ | ℓ | speedup (decoding) | ideal | efficiency | speedup (end to end) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tau']:g} | {r['achieved_tau']:.2f} | {r['length']} | {r['speedup']:.2f}x | {r['ideal']:.2f}x "
              f"| {r['efficiency']:.2f} | {r['end_to_end']:.2f}x |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "kernels": args.kernels, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
