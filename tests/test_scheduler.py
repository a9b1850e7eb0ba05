"""Verification policies as pure functions: table-driven cases."""

from __future__ import annotations

import pytest
import torch

from dspark_hf.scheduler import FixedPolicy, ThresholdPolicy, resolve_policy, survival_probabilities


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
