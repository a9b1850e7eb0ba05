"""The exact attention over packed rows of many sequences (`attention_segments`, the engine's unpadded forwards):
each sequence's rows are bit-identical to the same queries in a one-sequence `attention` call over its cache,
whatever other sequences are packed beside them and in whatever order; and close to SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_hf.kernels.build import backend

compiled = backend()
pytestmark = pytest.mark.skipif(compiled is None, reason="the exact kernels could not be built here")

HQ, HKV = 6, 2
NONE = torch.empty(0, dtype=torch.bool)


def _buffers(dim, capacity=96, slots=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(slots, HKV, capacity, dim, generator=gen),
        torch.randn(slots, HKV, capacity, dim, generator=gen),
    )


def _packed(segments, dim, seed=1):
    """Queries [1, HQ, N, D] of the segments (slot, past, length) one after another."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, HQ, sum(n for _, _, n in segments), dim, generator=gen)


def _alone(q, kbuf, vbuf, slot, past, n):
    """One sequence's queries [1, HQ, n, D] over its slot's first past + n keys (causal), as [n, HQ * D]."""
    k, v = kbuf[slot : slot + 1, :, : past + n], vbuf[slot : slot + 1, :, : past + n]
    return compiled.attention(q, k, v, NONE, 0.125).reshape(n, -1)


@pytest.mark.parametrize("dim", [64, 128, 40])  # the AVX-512 reduction (64, 128) and the lane-by-lane path
def test_each_sequence_of_a_packed_call_equals_the_sequence_alone(dim):
    kbuf, vbuf = _buffers(dim)
    segments = [(2, 0, 17), (0, 40, 1), (3, 5, 9), (1, 70, 5)]  # (slot, past, new rows): prefill chunks and decoding
    q = _packed(segments, dim)
    slots, pasts, lens = ([s[i] for s in segments] for i in range(3))
    out = compiled.attention_segments(q, kbuf, vbuf, slots, pasts, lens, 0.125)
    start = 0
    for slot, past, n in segments:
        alone = _alone(q[:, :, start : start + n], kbuf, vbuf, slot, past, n)
        assert torch.equal(out[start : start + n], alone)
        # and the math: SDPA over the same keys (GQA heads repeated), causal from position `past`
        k = kbuf[slot, :, : past + n].repeat_interleave(HQ // HKV, 0)[None]
        v = vbuf[slot, :, : past + n].repeat_interleave(HQ // HKV, 0)[None]
        mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        ref = F.scaled_dot_product_attention(q[:, :, start : start + n], k, v, attn_mask=mask, scale=0.125)
        torch.testing.assert_close(out[start : start + n], ref[0].transpose(0, 1).reshape(n, -1), atol=2e-6, rtol=1e-5)
        start += n


def test_packing_order_and_company_change_no_bit():
    dim = 64
    kbuf, vbuf = _buffers(dim)
    segments = [(0, 30, 4), (1, 0, 12), (2, 61, 1)]
    q = _packed(segments, dim)
    slots, pasts, lens = ([s[i] for s in segments] for i in range(3))
    full = compiled.attention_segments(q, kbuf, vbuf, slots, pasts, lens, 0.125)
    starts = [0, 4, 16, 17]
    # the last two sequences alone, then in reverse order
    sub = compiled.attention_segments(q[:, :, 4:], kbuf, vbuf, slots[1:], pasts[1:], lens[1:], 0.125)
    assert torch.equal(sub, full[4:])
    rev = [2, 1, 0]
    q_rev = torch.cat([q[:, :, starts[i] : starts[i + 1]] for i in rev], dim=2)
    out_rev = compiled.attention_segments(q_rev, kbuf, vbuf, [slots[i] for i in rev], [pasts[i] for i in rev],
                                          [lens[i] for i in rev], 0.125)  # fmt: skip
    assert torch.equal(out_rev, torch.cat([full[starts[i] : starts[i + 1]] for i in rev]))


def test_a_query_that_sees_one_more_key_differs():
    # control of the check above: the comparison notices a change of one visible key (past off by one)
    dim = 64
    kbuf, vbuf = _buffers(dim)
    q = _packed([(0, 20, 3)], dim)
    a = compiled.attention_segments(q, kbuf, vbuf, [0], [20], [3], 0.125)
    b = compiled.attention_segments(q, kbuf, vbuf, [0], [21], [3], 0.125)
    assert not torch.equal(a, b)


def test_segments_that_do_not_fit_are_refused():
    kbuf, vbuf = _buffers(64, capacity=16)
    q = _packed([(0, 10, 8)], 64)
    with pytest.raises(RuntimeError, match="outside the buffers"):
        compiled.attention_segments(q, kbuf, vbuf, [0], [10], [8], 0.125)
    with pytest.raises(RuntimeError, match="add up"):
        compiled.attention_segments(q, kbuf, vbuf, [0], [0], [5], 0.125)
