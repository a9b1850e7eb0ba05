"""The exact mode's packed GEMM (`exact_kernels.cpp`, `run_linears`): batch invariance at any row count, with power.

Every output element is one sequential fused multiply-add chain over k in ascending order, so row r of a k-row call
must equal (`torch.equal`) the same row computed alone, for k from 1 to 512 (the micro-kernel's full and edge row
tiles, the row blocks of a prefill), for weight shapes whose K and N are not multiples of the tile, with and without
bias; a prefill computed in chunks must equal the whole call; 1 and 2 threads must agree. The same checks must FAIL
for deliberately batch-variant kernels (torch's own `F.linear` on this CPU, a split-K reduction, and a kernel that
only changes its edge rows), which shows they can tell the difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_hf.kernels import build, exact_linear

KS = (1, 2, 3, 7, 8, 9, 16, 63, 64, 65, 255, 512)
SHAPES = [(576, 1536), (1536, 576), (100, 37)]  # (K, N): in/out features, neither a multiple of the 8 x 48 tile
CHUNKS = (1, 17, 128)

pytestmark = pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here")


def _data(k_in: int, n_out: int, rows: int = max(KS), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, k_in, generator=gen),
        torch.randn(n_out, k_in, generator=gen),
        torch.randn(n_out, generator=gen),
    )


def row_mismatches(linear, x, weight, bias, ks=KS) -> list[tuple[int, int]]:
    """(k, r) for every row r of a k-row call that is not bit-identical to the same row computed alone."""
    alone = torch.cat([linear(x[i : i + 1], weight, bias) for i in range(max(ks))])
    bad = []
    for k in ks:
        block = linear(x[:k], weight, bias)
        bad += [(k, r) for r in range(k) if not torch.equal(block[r], alone[r])]
    return bad


def chunk_mismatches(linear, x, weight, bias, chunks=CHUNKS) -> list[int]:
    """The chunk sizes whose chunked computation of all rows of x differs from the whole call."""
    whole = linear(x, weight, bias)
    return [
        c
        for c in chunks
        if not torch.equal(torch.cat([linear(x[i : i + c], weight, bias) for i in range(0, len(x), c)]), whole)
    ]


def _two_halves(x, weight, bias=None):
    """The product as the sum of two half-K products: another reduction order."""
    h = x.shape[1] // 2
    return exact_linear(x[:, :h], weight[:, :h]) + exact_linear(x[:, h:], weight[:, h:], bias)


def _split_k(x, weight, bias=None):
    """Batch-variant by design: calls of more than one row are split-K."""
    return exact_linear(x, weight, bias) if x.shape[0] == 1 else _two_halves(x, weight, bias)


def _variant_edge_rows(x, weight, bias=None):
    """Batch-variant only in its edge rows: the rows after the last multiple of 8 of a call of more than 8 rows
    go through split-K, the kind of bug a remainder-tile path could hide from a check of 1, 2 and 8 rows."""
    full = x.shape[0] // 8 * 8
    if x.shape[0] <= 8 or full == x.shape[0]:
        return exact_linear(x, weight, bias)
    return torch.cat([exact_linear(x[:full], weight, bias), _two_halves(x[full:], weight, bias)])


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_of_a_k_row_call_is_bit_identical_to_the_row_alone(shape, with_bias):
    x, weight, bias = _data(*shape)
    bias = bias if with_bias else None
    assert row_mismatches(exact_linear, x, weight, bias) == []
    assert chunk_mismatches(exact_linear, x, weight, bias) == []
    # and it is the product it claims to be (a sequential chain rounds a little more than a tree sum)
    torch.testing.assert_close(
        exact_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4 * shape[0] ** 0.5
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_one_and_two_threads_compute_the_same_bits(shape):
    x, weight, bias = _data(*shape)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [exact_linear(x[:k], weight, bias) for k in (1, 9, 512)]
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        two = [exact_linear(x[:k], weight, bias) for k in (1, 9, 512)]
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_the_kernel_computes_the_documented_chain():
    # out[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)): emulated in float64, where each product
    # of two floats is exact and the float32 rounding after each step is the fma's one rounding (up to double
    # rounding, which these inputs do not hit). A lane-wise or split sum would differ in most elements.
    x, weight, bias = _data(100, 37, rows=9, seed=5)
    acc = torch.zeros(9, 37, dtype=torch.float32)
    for k in range(100):
        acc = (x[:, k, None].double() * weight[None, :, k].double() + acc.double()).float()
    assert torch.equal(exact_linear(x, weight), acc)
    assert torch.equal(exact_linear(x, weight, bias), acc + bias)  # the bias: one IEEE add after the chain


def test_torch_linear_fails_the_same_checks():
    x, weight, bias = _data(576, 1536)
    bad = row_mismatches(F.linear, x, weight, bias)
    if not bad:
        pytest.skip("F.linear happens to be batch-invariant at this shape on this CPU; the controls below still fail")
    assert len(bad) > sum(KS) // 2, bad[:10]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_split_k_kernel_fails_the_same_checks(shape):
    x, weight, bias = _data(*shape)
    bad = row_mismatches(_split_k, x, weight, bias)
    assert {k for k, _ in bad} == set(KS) - {1}, bad[:10]
    assert chunk_mismatches(_split_k, x, weight, bias) == [1]  # chunks of 17 and 128 are split-K like the whole


def test_a_kernel_variant_only_in_its_edge_rows_fails_the_same_checks():
    x, weight, bias = _data(576, 1536)
    bad = row_mismatches(_variant_edge_rows, x, weight, bias)
    assert {k for k, _ in bad} == {9, 63, 65, 255}, bad[:10]  # the ks that are not multiples of 8
    # chunks of 17 leave an edge row in every chunk; chunks of 1 and 128 (and the whole call) have none
    assert chunk_mismatches(_variant_edge_rows, x, weight, bias) == [17]


def test_packed_copies_follow_in_place_updates_and_go_with_their_weights():
    compiled = build.backend()
    x, weight, bias = _data(100, 37, rows=4)
    before = compiled.pack_bytes()
    first = exact_linear(x, weight, bias)
    assert compiled.pack_bytes() > before
    with torch.no_grad():
        weight.mul_(2.0)  # an in-place update: the version counter moves, the copy is packed again
    assert torch.equal(exact_linear(x, weight, bias), exact_linear(x, weight.clone(), bias))
    assert not torch.equal(exact_linear(x, weight, bias), first)
    view = weight[5:20]  # a view of the same storage is its own weight
    assert torch.equal(exact_linear(x, view), exact_linear(x, view.clone()))
    held = compiled.pack_bytes()
    del weight, view
    assert compiled.pack_bytes() < held  # the copies of a freed weight are dropped
    compiled.pack_release()
    assert compiled.pack_bytes() == 0
