"""The training objective's pure functions: anchors, blocks, loss terms and acceptance estimates."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspark_hf.train.losses import (
    acceptance_estimates,
    build_blocks,
    dspark_loss,
    position_weights,
    sample_anchors,
    valid_anchor_positions,
)


def test_position_weights_decay():
    torch.testing.assert_close(
        position_weights(4), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)])
    )


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        ([0, 1, 1, 1, 0, 1, 1], [1, 2, 5]),  # a and a+1 supervised; a ≤ T-2
        ([1, 0, 1, 0, 1], []),
        ([1, 1], [0]),
    ],
)
def test_valid_anchor_positions(mask, expected):
    assert valid_anchor_positions(torch.tensor(mask, dtype=torch.bool)).tolist() == expected


def test_sample_anchors_uniform_without_replacement_sorted():
    mask = torch.ones(50, dtype=torch.bool)
    counts = torch.zeros(49)
    for seed in range(400):
        a = sample_anchors(mask, 10, torch.Generator().manual_seed(seed))
        assert a.numel() == 10 and torch.equal(a, a.sort().values) and a.unique().numel() == 10
        counts[a] += 1
    # 400·10/49 ≈ 81.6 draws per position; every position is drawn, none hugely over-represented
    assert counts.min() > 40 and counts.max() < 130
    assert sample_anchors(mask, None).tolist() == list(range(49))  # None = all valid anchors


def test_build_blocks_table():
    #           pos: 0  1  2  3  4  5  6  7
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    blocks = build_blocks(ids, mask, [torch.tensor([1, 5, 6])], block_size=3, mask_token_id=99)
    assert blocks.anchors.tolist() == [[1, 5, 6]]
    assert blocks.input_ids.tolist() == [[11, 99, 99, 15, 99, 99, 16, 99, 99]]
    assert blocks.position_ids.tolist() == [[1, 2, 3, 5, 6, 7, 6, 7, 8]]
    # anchor 1: labels 12, 13 supervised, 14 is not -> the block stops there (contiguous prefix)
    # anchor 5: labels 16, 17, then past the end; anchor 6: 17, then past the end
    assert blocks.valid.tolist() == [[1, 1, 0, 1, 1, 0, 1, 0, 0]]
    assert blocks.labels.tolist() == [[12, 13, 0, 16, 17, 0, 17, 0, 0]]
    assert blocks.prev_token_ids[0, :2].tolist() == [11, 12] and blocks.prev_token_ids[0, 3:5].tolist() == [15, 16]
    assert blocks.target_positions[0, :2].tolist() == [1, 2]  # the target at a+k predicts the label at a+k+1


def test_build_blocks_pads_rows_with_invalid_blocks():
    ids = torch.arange(20).reshape(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    blocks = build_blocks(ids, mask, [torch.tensor([2, 4]), torch.tensor([], dtype=torch.long)], 2, 0)
    assert blocks.input_ids.shape == (2, 4)
    assert blocks.valid[1].sum() == 0 and blocks.valid[0].all()


def _random_inputs(seed=0, slots=6, vocab=11, gamma=3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, slots, vocab, generator=g, requires_grad=True)
    target = torch.randn(2, slots, vocab, generator=g)
    labels = torch.randint(0, vocab, (2, slots), generator=g)
    valid = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    conf = torch.randn(2, slots, generator=g, requires_grad=True)
    return logits, target, labels, valid, conf, gamma


def test_dspark_loss_matches_manual_computation():
    logits, target, labels, valid, conf, gamma = _random_inputs()
    out = dspark_loss(logits, target, labels, valid, conf, block_size=gamma)
    w = position_weights(gamma).repeat(2)[None] * valid
    ce = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none").reshape(2, -1)
    l1 = (logits.softmax(-1) - target.softmax(-1)).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(conf, accept.detach(), reduction="none")
    expected = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / w.sum()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.l1, (w * l1).sum() / w.sum())
    # per-position TV statistics for accept@k
    tv = (0.5 * l1 * valid).reshape(2, 2, gamma).sum((0, 1))
    torch.testing.assert_close(out.tv_sum, tv.detach())
    assert out.count.tolist() == [3.0, 2.0, 1.0]


def test_l1_is_twice_total_variation_and_zero_for_identical_distributions():
    logits, _, labels, valid, conf, gamma = _random_inputs()
    out = dspark_loss(logits, logits.detach() + 5.0, labels, valid, conf, block_size=gamma)  # shift-invariant
    assert out.l1 < 1e-6 and out.tv_sum.abs().max() < 1e-6
    one_hot = torch.full((1, 3, 2), -1e9)
    one_hot[..., 0] = 0
    other = torch.full((1, 3, 2), -1e9)
    other[..., 1] = 0
    out = dspark_loss(
        one_hot, other, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), block_size=3
    )
    torch.testing.assert_close(out.l1, torch.tensor(2.0))  # disjoint supports: L1 = 2, TV = 1


def test_confidence_target_is_detached():
    """The BCE term trains the confidence head only; it must not pull the draft's distribution."""
    logits, target, labels, valid, conf, gamma = _random_inputs()
    out = dspark_loss(logits, target, labels, valid, conf, block_size=gamma, ce_weight=0.0, l1_weight=0.0)
    out.loss.backward()
    assert logits.grad is None or torch.count_nonzero(logits.grad) == 0
    assert conf.grad is not None and torch.count_nonzero(conf.grad) > 0


def test_invalid_slots_get_no_gradient_and_dflash_weights_give_plain_ce():
    logits, target, labels, valid, conf, gamma = _random_inputs()
    out = dspark_loss(
        logits, target, labels, valid, None, block_size=gamma, ce_weight=1.0, l1_weight=0.0, bce_weight=0.0
    )
    out.loss.backward()
    assert torch.count_nonzero(logits.grad[~valid]) == 0
    torch.testing.assert_close(out.loss, out.ce)
    assert out.bce == 0


def test_acceptance_estimates():
    tv_sum = torch.tensor([1.0, 4.0, 0.0])
    count = torch.tensor([10.0, 10.0, 0.0])
    est = acceptance_estimates(tv_sum, count)
    assert est["accept@1"] == pytest.approx(0.9) and est["accept@2"] == pytest.approx(0.6)
    assert est["accept@3"] == 0.0  # never observed counts as never accepted
    assert est["tau_est"] == pytest.approx(1 + 0.9 + 0.9 * 0.6)
