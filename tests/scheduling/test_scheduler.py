"""Verification policies as pure functions: table-driven cases."""

from __future__ import annotations

import pytest
import torch

from dspark_hf import last_generation_stats
from dspark_hf.scheduling.policies import (
    ConfidenceThresholdPolicy,
    FixedPolicy,
    ThresholdPolicy,
    resolve_policy,
    survival_probabilities,
)


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
        ("confidence_threshold:0.7", ConfidenceThresholdPolicy(0.7)),
        ("confidence_threshold", ConfidenceThresholdPolicy(0.5)),
    ],
)
def test_resolve(spec, expected):
    assert resolve_policy(spec) == expected


def test_the_two_threshold_rules_on_the_issue_example():
    """Confidence 0.9 at each of 7 positions, threshold 0.7: DeepSpec's rule verifies 7, the survival rule 3."""
    survival = survival_probabilities(torch.full((1, 7), 0.9))
    assert resolve_policy("confidence_threshold:0.7").choose_lengths(survival).tolist() == [7]
    assert resolve_policy("threshold:0.7").choose_lengths(survival).tolist() == [3]  # 0.9, 0.81, 0.729


def _deepspec_prefix(confidences: list[float], threshold: float) -> int:
    """DeepSpec's `_confident_prefix_length`, restated: index of the first confidence below the threshold."""
    if threshold <= 0.0:
        return len(confidences)
    below = [k for k, c in enumerate(confidences) if c < threshold]
    return below[0] if below else len(confidences)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5, 0.7, 0.95, 1.0])
def test_confidence_threshold_matches_deepspec_on_random_confidences(threshold):
    torch.manual_seed(0)
    confidences = torch.rand(200, 7, dtype=torch.float64) ** 0.3  # mostly high, as a trained head gives
    confidences[::7, 2] = 0.0  # a zero confidence ends the prefix (and makes later survival 0)
    got = ConfidenceThresholdPolicy(threshold).choose_lengths(survival_probabilities(confidences)).tolist()
    assert got == [_deepspec_prefix(row, threshold) for row in confidences.tolist()]
    # the survival rule is a different rule: it never verifies more, and here it verifies less somewhere
    product = ThresholdPolicy(threshold).choose_lengths(survival_probabilities(confidences)).tolist()
    assert all(p <= g for p, g in zip(product, got))
    if 0.0 < threshold < 1.0:
        assert product != got


def test_confidence_threshold_refuses_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ConfidenceThresholdPolicy(1.5)
    with pytest.raises(ValueError, match="confidence_threshold:T"):
        resolve_policy("deepspec:0.7")


def test_policy_precedence_in_generate():
    """generate(dspark_policy=...) > GenerationConfig.dspark_policy > the draft's generation config > fixed."""
    from transformers import GenerationConfig

    from helpers import make_aligned_draft, make_target

    target = make_target("llama", markov=True)
    draft = make_aligned_draft(target, "markov")
    ids = torch.randint(0, 96, (1, 6))
    kw = dict(max_new_tokens=12, do_sample=False, assistant_model=draft)
    target.generate(ids, **kw)
    assert last_generation_stats(draft).policy == repr(FixedPolicy())
    draft.generation_config.dspark_policy = "fixed:2"
    target.generate(ids, **kw)
    assert last_generation_stats(draft).policy == repr(FixedPolicy(2))
    target.generate(
        ids, generation_config=GenerationConfig(max_new_tokens=12, dspark_policy="fixed:3"), assistant_model=draft
    )
    assert last_generation_stats(draft).policy == repr(FixedPolicy(3))
    target.generate(ids, dspark_policy="threshold:0.1", **kw)
    assert last_generation_stats(draft).policy == repr(ThresholdPolicy(0.1))
    assert draft.generation_config.dspark_policy == "fixed:2"  # a call's policy is for that call only
    with pytest.raises(ValueError, match="only applies"):
        target.generate(ids, max_new_tokens=3, dspark_policy="fixed")
