"""Speculative *sampling* through the batched engine is exact, for every request of a concurrent batch.

The procedure of `tests/decoding/test_sampling_exactness.py` (same tiny 4-token fp64 target, prompt `[1, 2]`, exact
joint of the first three generated tokens by enumeration, over-confident draft whose confidences depend on
the previous drafted token, Pearson chi-square at alpha = 0.001), but the N = 3000 scored requests run
through one `DSparkEngine` with `max_batch_size=12`: requests are admitted as others finish (continuous
batching) and share every drafting round, every batch-wide scheduling decision and every padded/packed
verification forward with other requests. One in four requests is a *distractor* with a different prompt
(3 to 12 tokens) and a different `max_new_tokens`, so rows really are ragged; only the scored requests are
counted. With the hardware-aware policies the verification length of a request depends on the survival of
the *other* requests in the batch: the test checks that this batch-wide scheduling stays lossless.

Power: as in the single-request test, the power against moving 0.02 of probability mass between any two
cells is >= 0.98 at N = 3000 (`test_power_against_a_two_percent_shift` there). Negative control: the
engine's acceptance rule biased to accept when `u <= 1.15 p/q` must fail (p < alpha).
Runtime: about 6-8 s per policy on one thread.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats
from test_sampling_exactness import (
    ACCEPTANCE_BIAS,
    ALPHA,
    JAGGED,
    LOGIT_SCALE,
    MAX_NEW_TOKENS,
    PROMPT,
    VOCAB,
    WINDOW,
    _exact_joint,
    _make_draft,
)

import dspark_hf.decoding.target_forward as target_forward
from dspark_hf import DSparkEngine
from dspark_hf.decoding.verification import residual_distribution
from dspark_hf.scheduling.policies import HardwareAwarePolicy, LaggedHardwareAwarePolicy, UniformHardwareAwarePolicy
from dspark_hf.scheduling.sps import SPSProfile

from helpers import make_target, sampled_workload_with_distractors


class _ProfileClockUniform(UniformHardwareAwarePolicy):
    """The uniform policy fed its SPS profile's round times instead of this shared host's clock: its batch-wide
    lengths then depend only on the survival it sees (what this test is about), not on the host's load, so the
    test drafts enough to have power on a busy machine too."""

    def observe_round(self, context, rows, forward_tokens, rest_seconds, draft_seconds=None, **kwargs):
        steady = self.sps.time(forward_tokens)
        super().observe_round(
            context, rows, forward_tokens, steady, draft_seconds=None if draft_seconds is None else 0.0, **kwargs
        )


N = 3000  # scored requests
DISTRACTOR_EVERY = 4
MAX_BATCH = 12
SEED = 4242
POLICIES = {
    "fixed": "fixed",
    "threshold": "threshold:0.5",
    "hardware_aware": HardwareAwarePolicy(sps=JAGGED),
    "hardware_aware_lagged": LaggedHardwareAwarePolicy(sps=JAGGED),
    # forwards of up to 24 tokens cost the same: the batch-wide length grows as the batch shrinks
    "hardware_aware_uniform": _ProfileClockUniform(sps=SPSProfile({1: 0.01, 24: 0.01, 25: 0.05, 1024: 1.0})),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", vocab_size=VOCAB, num_layers=2, markov=True, logit_scale=LOGIT_SCALE)
    return target, _exact_joint(target), _make_draft(target)


def _sample(target, draft, policy, layout: str = "padded") -> tuple[np.ndarray, dict]:
    torch.manual_seed(SEED)
    work = sampled_workload_with_distractors(PROMPT[0].tolist(), N, MAX_NEW_TOKENS, VOCAB, SEED, DISTRACTOR_EVERY)
    prompts, params, scored = work
    engine = DSparkEngine(target, draft, policy=policy, max_batch_size=MAX_BATCH, layout=layout)
    outputs = engine.generate(prompts, params)
    index = {cell: i for i, cell in enumerate(itertools.product(range(VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    for i in scored:
        assert len(outputs[i].token_ids) == MAX_NEW_TOKENS
        counts[index[tuple(outputs[i].token_ids[:WINDOW])]] += 1
    return counts, engine.metrics.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_engine_sampling_matches_target_joint(setup, policy):
    target, joint, draft = setup
    layout = "packed" if policy == "hardware_aware" else "padded"  # both layouts see sampling
    counts, m = _sample(target, draft, POLICIES[policy], layout)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    lengths = m["length_counts"]
    print(f"\n{policy}/{layout}: p={p_value:.4g} tau={m['tau']:.2f} lengths={lengths} peak={m['peak_active_requests']}")
    assert p_value >= ALPHA, f"{policy}: first-{WINDOW}-token joint differs from the target's (p={p_value:.3g})"
    assert m["peak_active_requests"] == MAX_BATCH and m["drafts_accepted"] >= 0.5 * m["drafts_verified"] > N
    if policy != "fixed":  # confidence-driven policies verify different lengths, sometimes none
        assert lengths[0] > 0.05 * N and sum(c > 0.02 * N for c in lengths) >= 3, lengths


@pytest.mark.slow
def test_biased_acceptance_is_detected_through_the_engine(setup, monkeypatch):
    """The engine's rejection sampler, made to accept when `u <= 1.15 p/q`, must fail the same test."""
    target, joint, draft = setup

    def biased(draft_tokens, q_probs, p_probs, generator=None):  # `speculative_accept` with a biased test
        idx = torch.arange(draft_tokens.numel())
        p_x, q_x = p_probs[idx, draft_tokens], q_probs[idx, draft_tokens]
        u = torch.rand(draft_tokens.numel(), generator=generator, dtype=p_probs.dtype)
        n = int(torch.cumprod((u * q_x <= ACCEPTANCE_BIAS * p_x).long(), dim=0).sum())
        dist = residual_distribution(p_probs[n], q_probs[n]) if n < draft_tokens.numel() else p_probs[n]
        return n, int(torch.multinomial(dist, 1, generator=generator))

    monkeypatch.setattr(target_forward, "speculative_accept", biased)
    counts, _ = _sample(target, draft, "fixed")
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nbiased acceptance through the engine: p={p_value:.4g}")
    assert p_value < ALPHA
