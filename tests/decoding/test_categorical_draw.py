"""`categorical_draw`: the inverse-CDF sampler behind every sampled draft token and engine-sampled target token.

Checked by Pearson's chi-square goodness of fit over 60,000 draws per row, with a deliberately wrong sampler
(the same weights at temperature 1.1) that the same test must reject, and by direct checks that an index
of weight 0 is never drawn (leading, inner and trailing zeros, as the `-inf` logits outside a draft vocabulary
give), that rows are independent distributions, and that a seeded generator repeats its draws.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf.decoding.drafting import exponential_race
from dspark_hf.decoding.verification import categorical_draw

stats = pytest.importorskip("scipy.stats")

N = 60_000
ALPHA = 1e-3


def _weights() -> torch.Tensor:
    """Two rows over 24 indices: a skewed one with zeros at both ends and inside, and a flatter one."""
    g = torch.Generator().manual_seed(3)
    w = torch.rand(2, 24, generator=g, dtype=torch.float64) ** 3
    w[0, :3] = 0
    w[0, 10] = 0
    w[0, -4:] = 0
    w[1] = w[1] + 0.2
    return w


def _counts(draw, weights: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([draw(weights, g) for _ in range(N)])  # [N, R]
    return torch.stack([torch.bincount(picks[:, r], minlength=weights.shape[1]) for r in range(weights.shape[0])])


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    return float(stats.chisquare(counts[keep].double().numpy(), (N * probs[keep]).numpy()).pvalue)


def test_draws_follow_the_weights_and_a_wrong_sampler_is_rejected():
    weights = _weights()
    probs = weights / weights.sum(dim=-1, keepdim=True)
    counts = _counts(categorical_draw, weights * 7.5)  # unnormalised weights: the draw scales by the row's sum
    for r in range(weights.shape[0]):
        assert counts[r][probs[r] == 0].sum() == 0
        assert _p_value(counts[r], probs[r]) > ALPHA

    def hotter(w, g):  # the same draw from the weights at temperature 1.1: a small, systematic error
        return categorical_draw(torch.where(w > 0, w ** (1 / 1.1), 0.0), g)

    wrong = _counts(hotter, weights)
    assert _p_value(wrong[0], probs[0]) < ALPHA


def test_zero_weights_are_never_drawn_even_at_the_edges():
    weights = torch.zeros(3, 49_152, dtype=torch.float64)
    weights[0, 0] = 1.0  # one index at the start
    weights[1, -1] = 1.0  # one index at the end
    weights[2, 17] = 1e-300  # a tiny but positive weight next to zeros
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        assert categorical_draw(weights, g).tolist() == [0, 49_151, 17]


def test_float32_softmax_rows_with_minus_inf_logits():
    logits = torch.full((4, 1000), float("-inf"))
    keep = torch.randperm(1000, generator=torch.Generator().manual_seed(2))[:50]
    logits[:, keep] = torch.randn(4, 50)
    g = torch.Generator().manual_seed(4)
    for _ in range(500):
        tokens = exponential_race(logits, g)
        assert torch.isin(tokens, keep).all()


def test_seeded_generators_repeat_their_draws():
    weights = _weights()
    a = [categorical_draw(weights, torch.Generator().manual_seed(9)) for _ in range(3)]
    assert all(torch.equal(a[0], x) for x in a)
    g = torch.Generator().manual_seed(9)
    seq = torch.stack([categorical_draw(weights, g) for _ in range(50)])
    assert len({tuple(x) for x in seq.tolist()}) > 1  # the generator advances between draws
