"""The default policy for a calibrated draft never pays for a draft it then declines.

Setting: verification is expensive (every token costs a whole forward), so no verified length pays for the
draft. The default policy must then skip drafting (a round that drafts verifies at least one token), while
Algorithm 1 (`hardware_aware`, which decides after drafting) drafts and declines: the negative control that
shows the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf import DSparkEngine, SamplingParams, last_generation_stats
from dspark_hf.scheduling import sps
from dspark_hf.scheduling.policies import AdaptivePolicy, FixedPolicy, UniformHardwareAwarePolicy, resolve_policy

from helpers import make_aligned_draft, make_target

STEEP = {1: 0.1, 2: 0.2, 64: 6.4}  # each verified token costs a full forward


def _run(monkeypatch, policy):
    monkeypatch.setattr(sps, "get_sps_profile", lambda target, **kw: sps.SPSProfile(STEEP))
    target = make_target("llama", markov=True)
    draft = make_aligned_draft(target, block_size=5)
    draft.config.confidence_calibrated = True  # the default then is the hardware-aware default
    prompt = torch.tensor([[5, 17, 3, 9]])
    out = target.generate(prompt, assistant_model=draft, dspark_policy=policy, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=24, do_sample=False))  # lossless either way
    return last_generation_stats(draft)


def declined_drafts(stats) -> int:
    return sum(1 for r in stats.rounds if r.drafted and r.verified == 0)


def test_default_policy_for_a_calibrated_draft_never_drafts_in_vain(monkeypatch):
    assert isinstance(resolve_policy(None, has_confidence=True, calibrated=True), UniformHardwareAwarePolicy)
    stats = _run(monkeypatch, None)
    assert "Uniform" in stats.policy and stats.num_rounds > 5
    assert declined_drafts(stats) == 0


def test_algorithm_1_pays_for_declined_drafts_in_the_same_setting(monkeypatch):
    stats = _run(monkeypatch, "hardware_aware")
    assert declined_drafts(stats) > 0


@pytest.mark.parametrize("policy", ["fixed", "fixed:2"])
def test_fixed_policies_never_decline(monkeypatch, policy):
    assert declined_drafts(_run(monkeypatch, policy)) == 0


def test_a_drafts_recorded_default_policy_applies_when_the_call_names_none(monkeypatch):
    """The draft's recorded `dspark_policy` (its `generation_config.json`, as the shipped drafts record theirs)
    is used when neither the call nor its generation config names a policy; a policy
    named in the call still wins."""
    monkeypatch.setattr(sps, "get_sps_profile", lambda target, **kw: sps.SPSProfile(STEEP))
    target = make_target("llama", markov=True)
    draft = make_aligned_draft(target, block_size=5)
    draft.config.confidence_calibrated = True
    draft.generation_config.dspark_policy = "fixed:2"
    prompt = torch.tensor([[5, 17, 3, 9]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, plain)
    stats = last_generation_stats(draft)
    assert "FixedPolicy(n=2)" in stats.policy, stats.policy
    assert {r.verified for r in stats.rounds if r.drafted} <= {1, 2} and any(r.verified == 2 for r in stats.rounds)
    target.generate(prompt, assistant_model=draft, dspark_policy="hardware_aware_uniform", max_new_tokens=24)
    assert "Uniform" in last_generation_stats(draft).policy
    draft.generation_config.dspark_policy = None
    target.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False)
    assert "Uniform" in last_generation_stats(draft).policy


def test_the_engine_runs_the_drafts_recorded_default_policy_like_generate(monkeypatch):
    """`DSparkEngine` (and so `dspark serve`) without `policy=` runs the draft's recorded default, as `generate()`
    does (one resolver, `dspark_hf.decoding.options`), else the library's; a policy named to the engine wins."""
    monkeypatch.setattr(sps, "get_sps_profile", lambda target, **kw: sps.SPSProfile(STEEP))
    target = make_target("llama", markov=True)
    draft = make_aligned_draft(target, block_size=5)
    draft.config.confidence_calibrated = True
    draft.generation_config.dspark_policy = "adaptive:3"
    assert DSparkEngine(target, draft).policy == AdaptivePolicy(3)
    assert DSparkEngine(target, draft, policy="fixed:2").policy == FixedPolicy(2)
    draft.generation_config.dspark_policy = None
    assert isinstance(DSparkEngine(target, draft).policy, UniformHardwareAwarePolicy)
    engine = DSparkEngine(target, draft, policy="adaptive:2")
    assert engine.policy == AdaptivePolicy(2)
    prompt = [5, 17, 3, 9]
    plain = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    out = engine.generate([prompt], SamplingParams(max_new_tokens=16))[0]
    assert out.token_ids[: len(plain)] == plain
