"""Prompt lookup in the batched engine (`DSparkEngine(lookup=...)`, `dspark_hf.decoding.lookup`).

Greedy: every request's output equals plain `generate()` on its prompt alone while copy rounds, drafting
rounds and plain rounds alternate under continuous batching (three architectures, both layouts), and the
draft's context stays the target's features. Sampling: the chi-square procedure of `tests/decoding/test_lookup.py`
(4-token vocabulary, most verified tokens copied) through one engine batch of 12 with distractor requests,
and its negative control: a copy accepted with the target's probability of it and, when rejected, replaced
by a fresh draw from the target that may be the copied token again (a plausible bug) must fail. The payoff
gate's verdicts are checked on scripted round times.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats
from test_lookup import ALPHA, LOOKUP, PROMPT, VOCAB, WINDOW, N, _repetitive_prompts, sampling_setup  # noqa: F401

import dspark_hf.decoding.target_forward as engine_module  # the engine accepts rows there (accept_rows)
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.decoding.lookup import LookupConfig, LookupGate
from dspark_hf.decoding.verification import categorical_draw
from dspark_hf.scheduling.policies import UniformHardwareAwarePolicy
from dspark_hf.scheduling.sps import SPSProfile

from helpers import assert_context_is_the_targets, make_aligned_draft, make_target, sampled_workload_with_distractors

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(target, draft, **kwargs) -> DSparkEngine:
    """An engine whose lookup gate never rules: these tests are about exactness, not about this host's clock."""
    engine = DSparkEngine(target, draft, **kwargs)
    engine.lookup_gate = LookupGate(after=0)
    return engine


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_engine_output_with_lookup_is_identical(arch, layout):
    target = make_target(arch, vocab_size=96, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=5)
    work = _repetitive_prompts(96)
    refs = [target.generate(ids, max_new_tokens=m, do_sample=False)[0, ids.shape[1] :].tolist() for ids, m in work]
    engine = _engine(target, draft, policy="fixed", max_batch_size=3, layout=layout, lookup=True)
    outputs = engine.generate([ids for ids, _ in work], [SamplingParams(max_new_tokens=m) for _, m in work])
    for out, ref in zip(outputs, refs):
        assert out.ok, out.error
        assert out.token_ids == ref, f"{arch}/{layout}: engine output with lookup differs"
        assert sum(r.accepted + 1 for r in out.stats.rounds) + 1 == len(out.token_ids)
        assert all(r.verified <= 5 for r in out.stats.rounds)
    m = engine.metrics
    assert m.lookup_rounds > 0 and m.lookup_request_rounds >= m.lookup_rounds and m.drafting_rounds > 0
    assert 0 < m.lookup_accepted <= m.lookup_verified
    assert m.tau > 1 + m.drafts_accepted / m.request_rounds  # copies count in τ ...
    assert sum(m.verified_at) == m.drafts_verified  # ... and stay out of the draft's acceptance curve
    assert any({r.source for r in out.stats.rounds} == {"draft", "lookup"} for out in outputs)
    text = m.to_prometheus()
    assert f"dspark_engine_lookup_rounds_total {m.lookup_rounds}" in text.replace(".0\n", "\n")


def test_the_drafts_context_stays_the_targets_across_copy_rounds():
    """Copy rounds do not run the draft: their tokens' features reach it at its next drafting round, in order."""
    target = make_target("llama", vocab_size=96, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=5)
    ids, _ = _repetitive_prompts(96)[5]
    seen = []
    original = draft.context_kv

    def recording(context, positions):  # the engine writes the draft's context through `context_kv`
        seen.append((context, positions))
        return original(context, positions)

    draft.context_kv = recording
    engine = _engine(target, draft, policy="fixed", max_batch_size=1, lookup=True)
    out = engine.generate([ids], SamplingParams(max_new_tokens=30))[0]
    kinds = [r.source for r in out.stats.rounds]
    assert "lookup" in kinds and "draft" in kinds[kinds.index("lookup") :], kinds
    full = torch.cat([ids, torch.tensor([out.token_ids])], dim=1)
    assert_context_is_the_targets(target, draft, seen, full)


def test_lookup_setting_precedence_in_the_engine():
    target = make_target("llama", vocab_size=96, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=5)
    assert DSparkEngine(target, draft, policy="fixed").lookup is None  # the library default
    draft.generation_config.dspark_lookup = True  # what a shipped draft records
    try:
        assert DSparkEngine(target, draft, policy="fixed").lookup == LookupConfig()
        assert DSparkEngine(target, draft, policy="fixed", lookup=False).lookup is None
        assert DSparkEngine(target, draft, policy="fixed", lookup=3).lookup == LookupConfig(max_tokens=3)
        assert DSparkEngine(target, draft, policy="none").lookup is None  # no speculation: no copies either
    finally:
        draft.generation_config.dspark_lookup = None


def test_the_gate_stops_copying_where_it_loses_and_probes_again():
    gate = LookupGate(after=2, explore=3, explore_max=12)
    # batch 1: copy rounds emit 3 tokens in 0.1 s, plain rounds 1 token in 0.08 s: copying pays there
    for _ in range(3):
        assert gate.allows(1)
        gate.observe(1, False, 1, 0.08)
        gate.observe(1, True, 3, 0.1)
    assert gate.allows(1)
    # batch 4: copies emit 4.5 tokens in 0.2 s against 4 in 0.15 s (a loss): after two copy rounds, no more
    gate.observe(4, False, 4, 0.15)
    for _ in range(2):
        assert gate.allows(4)
        gate.observe(4, True, 4.5, 0.2)
    assert not gate.allows(4) and not gate.allows(8)  # the verdict also stands for a larger batch
    assert gate.allows(2)  # ... not for a smaller one
    waits = []
    for _ in range(40):  # a probe after 3 plain rounds, then after 6, then 12 (the wait doubles, capped)
        if gate.allows(4):
            waits.append(gate.since.get(4, 0))
            gate.observe(4, True, 4.5, 0.2)
        else:
            gate.observe(4, False, 4, 0.15)
    assert waits == [3, 6, 12, 12], waits
    # a probe that pays turns the verdict and resets the wait
    while not gate.allows(4):
        gate.observe(4, False, 4, 0.15)
    gate.observe(4, True, 12, 0.15)
    assert gate.allows(4) and gate.waits[4] == 3


def test_copy_length_weighs_expected_acceptance_against_the_wider_forward():
    """With an SPS profile, a copy round verifies the one length that pays: at one request a forward of up to 4
    tokens costs what one token costs, so a copy is verified up to 3 tokens; at 4 requests every extra token
    position costs 4 more tokens, which this profile makes 100x dearer, so no copy round happens at all."""
    target = make_target("llama", vocab_size=96, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=5)
    profile = SPSProfile({1: 0.01, 4: 0.01, 5: 1.0, 64: 10.0})
    engine = DSparkEngine(target, draft, policy=UniformHardwareAwarePolicy(sps=profile), lookup=True)
    gate = engine.lookup_gate
    assert engine._copy_length([[1, 2, 3, 4, 5]]) == 3
    assert engine._copy_length([[1, 2, 3, 4, 5], [], [], []]) == 0
    # the expected gain per position follows the measured acceptance: copies that were never accepted ...
    for _ in range(50):
        gate.record(5, 0)
    assert gate.survival([[1, 2, 3]])[0] < 0.05
    # ... and a second row without a copy halves the batch's mean
    gate = LookupGate()
    for _ in range(50):
        gate.record(5, 5)
    torch.testing.assert_close(gate.survival([[1, 2], []]), gate.survival([[1, 2]]) / 2)
    # without a profile (a fixed policy), the whole copy
    assert DSparkEngine(target, draft, policy="fixed", lookup=True)._copy_length([[1, 2, 3, 4, 5], []]) == 5


# ---------------------------------------------------------------------------------------------- sampling
MAX_BATCH = 12


def _sample_counts(target, draft) -> tuple[np.ndarray, dict]:
    torch.manual_seed(1)
    prompts, params, scored = sampled_workload_with_distractors(PROMPT[0].tolist(), N, WINDOW + 1, VOCAB, seed=1)
    engine = _engine(target, draft, policy="fixed", max_batch_size=MAX_BATCH, lookup=LOOKUP)
    outputs = engine.generate(prompts, params)
    index = {cell: i for i, cell in enumerate(itertools.product(range(VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    for i in scored:
        counts[index[tuple(outputs[i].token_ids[:WINDOW])]] += 1
    return counts, engine.metrics.to_dict()


@pytest.mark.slow
def test_engine_sampling_with_lookup_matches_the_targets_joint(sampling_setup):  # noqa: F811
    """Chi-square of the first 3 sampled tokens (64 cells, N = 3000, alpha = 0.001, the power argument of
    `tests/decoding/test_sampling_exactness.py`) with most verified tokens copied, both accepted and rejected copies."""
    target, joint = sampling_setup
    draft = make_aligned_draft(target, block_size=4)
    counts, m = _sample_counts(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nengine lookup sampling: p={p_value:.4g} copies {m['lookup_accepted']}/{m['lookup_verified']}")
    assert p_value >= ALPHA, f"the first-{WINDOW}-token joint differs from the target's (p={p_value:.3g})"
    assert m["lookup_verified"] > max(N, m["drafts_verified"]) and m["peak_active_requests"] == MAX_BATCH, m
    assert 0.1 * m["lookup_verified"] < m["lookup_accepted"] < 0.9 * m["lookup_verified"], m


@pytest.mark.slow
def test_a_copy_rule_that_redraws_after_a_rejection_is_detected(sampling_setup, monkeypatch):  # noqa: F811
    """The negative control: accept copied token `x` with probability `p(x)`, and on rejection emit a fresh draw
    from `p` (which may be `x` again: the residual should exclude it). It over-weights copies; it must fail."""
    target, joint = sampling_setup
    draft = make_aligned_draft(target, block_size=4)

    def redraw(sampler, history, copy, target_logits):
        probs = torch.softmax(target_logits.double(), dim=-1)
        for i, token in enumerate(copy):
            u = torch.rand((), generator=sampler.generator, dtype=torch.float64)
            if u >= probs[i, token]:
                return i, int(categorical_draw(probs[i][None], sampler.generator)[0])
        return len(copy), int(categorical_draw(probs[len(copy)][None], sampler.generator)[0])

    monkeypatch.setattr(engine_module, "accept_copy_row", redraw)
    counts, m = _sample_counts(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nengine lookup with a redraw after rejection: p={p_value:.4g}")
    assert p_value < ALPHA
