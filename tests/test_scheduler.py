"""Verification policies as pure functions: table-driven cases."""

from __future__ import annotations

import pytest
import torch

from dspark_hf.scheduling.policies import FixedPolicy, ThresholdPolicy, resolve_policy, survival_probabilities


def test_survival_is_cumulative_product():
    c = torch.tensor([[0.9, 0.5, 1.0, 0.2]])
    assert torch.allclose(survival_probabilities(c), torch.tensor([[0.9, 0.45, 0.45, 0.09]]))


@pytest.mark.parametrize(
    "policy, survival, expected",
    [
        (FixedPolicy(), [[0.9, 0.5, 0.1]], [3]),
        (FixedPolicy(2), [[0.9, 0.5, 0.1], [0.1, 0.0, 0.0]], [2, 2]),
        (FixedPolicy(0), [[0.9, 0.5, 0.1]], [0]),
        (FixedPolicy(9), [[0.9, 0.5, 0.1]], [3]),
        (ThresholdPolicy(0.5), [[0.9, 0.5, 0.1]], [2]),
        (ThresholdPolicy(0.95), [[0.9, 0.5, 0.1]], [0]),
        (ThresholdPolicy(0.0), [[0.9, 0.5, 0.1]], [3]),
        (ThresholdPolicy(0.3), [[0.9, 0.5, 0.1], [0.2, 0.1, 0.05], [1.0, 1.0, 0.99]], [2, 0, 3]),
        # stops at the first miss even if a later value were higher (never peeks past a "no")
        (ThresholdPolicy(0.5), [[0.9, 0.4, 0.6]], [1]),
    ],
)
def test_policy_table(policy, survival, expected):
    assert policy.choose_lengths(torch.tensor(survival)).tolist() == expected


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, FixedPolicy()),
        ("fixed", FixedPolicy()),
        ("fixed:3", FixedPolicy(3)),
        ("threshold:0.25", ThresholdPolicy(0.25)),
    ],
)
def test_resolve(spec, expected):
    assert resolve_policy(spec) == expected


def test_policy_precedence_in_generate():
    """generate(dspark_policy=...) > GenerationConfig.dspark_policy > draft.policy > fixed."""
    from transformers import GenerationConfig

    from helpers import make_aligned_draft, make_target

    target = make_target("llama", markov=True)
    draft = make_aligned_draft(target, "markov")
    ids = torch.randint(0, 96, (1, 6))
    kw = dict(max_new_tokens=12, do_sample=False, assistant_model=draft)
    target.generate(ids, **kw)
    assert draft.last_generation_stats.policy == repr(FixedPolicy())
    draft.policy = "fixed:2"
    target.generate(ids, **kw)
    assert draft.last_generation_stats.policy == repr(FixedPolicy(2))
    target.generate(
        ids, generation_config=GenerationConfig(max_new_tokens=12, dspark_policy="fixed:3"), assistant_model=draft
    )
    assert draft.last_generation_stats.policy == repr(FixedPolicy(3))
    target.generate(ids, dspark_policy="threshold:0.1", **kw)
    assert draft.last_generation_stats.policy == repr(ThresholdPolicy(0.1))
    assert draft._call_policy is None  # per call only
    with pytest.raises(ValueError, match="only applies"):
        target.generate(ids, max_new_tokens=3, dspark_policy="fixed")
