"""The exact kernels' bf16 GEMM (`linear_bf16`, `attn_in_bf16`, `attn_out_bf16`): batch invariance, with power.

x and w are rounded to bfloat16 (nearest even) and every output element is ONE chain of vdpbf16ps steps over the k
pairs in ascending order, so row r of a k-row call must equal (`torch.equal`) the same row computed alone, for k up
to 512, for shapes whose K is odd and N not a multiple of the 48-column panel, with and without bias, and through the
fused layer halves (the residual adds of `attn_out_bf16`); 1 and 2 threads must agree; the native AVX-512 BF16
kernel must equal the portable one bit for bit (also on data whose products and sums fall in the denormal range,
where vdpbf16ps flushes); both must equal a float64 emulation of the documented chain. `F.linear` on bf16 tensors
and a split-K variant must FAIL the same checks, which shows they can tell the difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_hf.kernels import build, exact_linear

KS = (1, 2, 3, 7, 8, 9, 16, 63, 64, 65, 255, 512)
# (K, N): SmolLM2-135M's q/o and down shapes, an odd K with N not a multiple of 48, a one-pair K
SHAPES = [(576, 576), (1536, 576), (101, 37), (1, 50)]
CHUNKS = (1, 17, 128)
TINY = 2.0**-126  # the smallest normal float32 (and bfloat16)

pytestmark = pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here")


def _compiled():
    return build.backend()


def linear_bf16(x, weight, bias=None):
    return exact_linear(x, weight, bias, bf16=True)


def _data(k_in: int, n_out: int, rows: int = max(KS), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, k_in, generator=gen),
        torch.randn(n_out, k_in, generator=gen) / k_in**0.5,
        torch.randn(n_out, generator=gen),
    )


def _extreme(rows: int, k_in: int, n_out: int, seed: int, low: int = -70, high: int = 60):
    """Values whose exponents span most of the float range: products and partial sums from overflow-free huge
    down to the denormal range, and every kind of cancellation."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k_in, generator=gen) * 2.0 ** torch.randint(low, high, (rows, k_in), generator=gen).float()
    w = torch.randn(n_out, k_in, generator=gen) * 2.0 ** torch.randint(low, high, (n_out, k_in), generator=gen).float()
    return x, w


def row_mismatches(linear, x, weight, bias, ks=KS) -> list[tuple[int, int]]:
    """(k, r) for every row r of a k-row call that is not bit-identical to the same row computed alone."""
    alone = torch.cat([linear(x[i : i + 1], weight, bias) for i in range(max(ks))])
    bad = []
    for k in ks:
        block = linear(x[:k], weight, bias)
        bad += [(k, r) for r in range(k) if not torch.equal(block[r], alone[r])]
    return bad


def chunk_mismatches(linear, x, weight, bias, chunks=CHUNKS) -> list[int]:
    whole = linear(x, weight, bias)
    return [
        c
        for c in chunks
        if not torch.equal(torch.cat([linear(x[i : i + c], weight, bias) for i in range(0, len(x), c)]), whole)
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _bf16_daz(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bfloat16 (nearest even), a denormal result replaced by a zero of its sign, as float64."""
    r = t.bfloat16().double()
    return torch.where(r.abs() < TINY, r * 0.0, r)


def emulate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The documented chain, in float64 with one rounding to float32 per step: for each k pair p in ascending order,
    acc = ftz(fma(x[2p + 1], w[2p + 1], acc)), then acc = ftz(fma(x[2p], w[2p], acc)) (an odd K's last pair: a zero
    in the odd slot). The products of two bf16 are exact in float64; every float64 sum is checked to be exact
    (TwoSum error 0), so the one rounding to float32 is the fma's."""
    xb, wb = _bf16_daz(x), _bf16_daz(w)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    order = []
    for p in range((x.shape[1] + 1) // 2):
        order += [k for k in (2 * p + 1, 2 * p) if k < x.shape[1]]
    for k in order:
        prod = xb[:, k, None] * wb[None, :, k]
        a = acc.double()
        s = a + prod
        bb = s - a
        assert torch.all((a - (s - bb)) + (prod - bb) == 0), "the float64 emulation is not exact for these inputs"
        acc = s.float()
        acc = torch.where(acc.abs() < TINY, acc * 0.0, acc)
    return acc


def _split_k(x, weight, bias=None):
    """Batch-variant by design: calls of more than one row are two half-K bf16 products added."""
    if x.shape[0] == 1:
        return linear_bf16(x, weight, bias)
    h = x.shape[1] // 2 // 2 * 2 or 1
    return linear_bf16(x[:, :h], weight[:, :h]) + linear_bf16(x[:, h:], weight[:, h:], bias)


# ------------------------------------------------------------------------------------------ invariance
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_of_a_k_row_call_is_bit_identical_to_the_row_alone(shape, with_bias):
    x, weight, bias = _data(*shape)
    bias = bias if with_bias else None
    assert row_mismatches(linear_bf16, x, weight, bias) == []
    assert chunk_mismatches(linear_bf16, x, weight, bias) == []


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_one_and_two_threads_compute_the_same_bits(shape):
    x, weight, bias = _data(*shape)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [linear_bf16(x[:k], weight, bias) for k in (1, 9, 512)]
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        two = [linear_bf16(x[:k], weight, bias) for k in (1, 9, 512)]
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


# ------------------------------------------------------------------------------------------ what it computes
@pytest.mark.parametrize("shape", [(101, 37), (64, 50), (7, 100)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_kernel_computes_the_documented_chain(shape):
    x, weight, bias = _data(*shape, rows=9, seed=5)
    acc = emulate(x, weight)
    assert torch.equal(linear_bf16(x, weight), acc)
    assert torch.equal(linear_bf16(x, weight, bias), acc + bias)  # the bias: one IEEE add after the chain
    assert torch.equal(_compiled().linear_bf16_portable(x, weight, None), acc)


def test_the_chain_flushes_denormals_as_vdpbf16ps_does():
    # products of about 2^-128 .. 2^-116 and sums crossing the denormal range, denormal inputs (flushed), and
    # cancellations to exact zeros: here the flush rules decide the bits
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=gen) * 2.0**-64
    w = torch.randn(30, 40, generator=gen) * 2.0**-60
    x[0, :6] = torch.tensor([1e-39, -1e-39, 3e-40, 2.0**-127, -(2.0**-130), 5e-41])  # float32 denormals
    w[:, 40 - 1] = -w[:, 38]  # x row 1's last pair cancels the one before
    x[1, 39], x[1, 38] = x[1, 38].item(), x[1, 38].item()
    acc = emulate(x, w)
    assert (acc == 0).sum() > 0 and ((acc.abs() > 0) & (acc.abs() < 2.0**-100)).sum() > 0  # the range is exercised
    assert torch.equal(_bits(linear_bf16(x, w)), _bits(acc))
    assert torch.equal(_bits(_compiled().linear_bf16_portable(x, w, None)), _bits(acc))


def test_the_native_kernel_equals_the_portable_one_bit_for_bit():
    compiled = _compiled()
    if not compiled.bf16_native():
        pytest.skip("this build has no AVX-512 BF16: linear_bf16 runs the portable kernel itself")
    for shape in SHAPES:
        x, weight, bias = _data(*shape, rows=70)
        assert torch.equal(
            _bits(compiled.linear_bf16(x, weight, bias)), _bits(compiled.linear_bf16_portable(x, weight, bias))
        )
    for seed in range(40):  # exponents over most of the float range: tiny, denormal and huge products
        x, w = _extreme(9, 64 + seed % 3, 50, seed)
        assert torch.equal(_bits(compiled.linear_bf16(x, w, None)), _bits(compiled.linear_bf16_portable(x, w, None)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_close_to_the_product_of_the_bf16_rounded_operands(shape):
    x, weight, bias = _data(*shape, rows=64)
    out = linear_bf16(x, weight, bias)
    ref = F.linear(x.bfloat16().double(), weight.bfloat16().double(), bias.double()).float()
    # float32 sums of exact products: a sequential chain's rounding, nothing of bf16's
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * shape[0] ** 0.5)
    torch.testing.assert_close(
        out, F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias), rtol=1e-4, atol=1e-4
    )
    if shape[0] > 1:  # and it is not the float32 product: the operands were rounded
        assert not torch.equal(out, exact_linear(x, weight, bias))


# ------------------------------------------------------------------------------------------ the checks have power
def test_torch_linear_of_the_rounded_operands_fails_the_same_checks():
    # the same mathematical product (float32 GEMM of the bf16-rounded x and w) on torch's own kernel
    x, weight, bias = _data(576, 1536)
    xr, wr = x.bfloat16().float(), weight.bfloat16().float()
    bad = row_mismatches(lambda x, w, b: F.linear(x, w, b), xr, wr, bias)
    if not bad:
        pytest.skip("F.linear happens to be batch-invariant at this shape on this CPU; split-K still fails")
    assert len(bad) > sum(KS) // 2, bad[:10]


def test_torch_bf16_linear_fails_the_same_checks():
    # oneDNN's bf16 GEMM: its bf16 output hides most of its reordering, but not all of it at K = 1536
    x, weight, bias = _data(1536, 576)
    stock = lambda x, w, b: F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()  # noqa: E731
    bad = row_mismatches(stock, x, weight, bias)
    if not bad:
        pytest.skip("F.linear in bf16 happens to be batch-invariant at this shape on this CPU; split-K still fails")
    assert {k for k, _ in bad} <= set(KS) - {1}, bad[:10]


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_split_k_kernel_fails_the_same_checks(shape):
    x, weight, bias = _data(*shape)
    bad = row_mismatches(_split_k, x, weight, bias)
    assert {k for k, _ in bad} == set(KS) - {1}, bad[:10]
    assert chunk_mismatches(_split_k, x, weight, bias) == [1]


# ------------------------------------------------------------------------------------------ the fused layer halves
def _layer(W=96, hq=3, hkv=1, D=32, inter=200, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    return dict(
        ln_in=1.0 + 0.1 * r(W),
        wq=r(hq * D, W, scale=W**-0.5),
        bq=r(hq * D),
        wk=r(hkv * D, W, scale=W**-0.5),
        wv=r(hkv * D, W, scale=W**-0.5),
        wo=r(W, hq * D, scale=(hq * D) ** -0.5),
        bo=r(W),
        ln_post=1.0 + 0.1 * r(W),
        wg=r(inter, W, scale=W**-0.5),
        wu=r(inter, W, scale=W**-0.5),
        wd=r(W, inter, scale=inter**-0.5),
        bd=r(W),
        hq=hq,
        hkv=hkv,
        D=D,
        W=W,
    )


def _rope_tables(T, D):
    pos = torch.arange(T, dtype=torch.float32)[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    return ang.cos()[None], ang.sin()[None]


def _attn_in(fn, L, x, cos, sin):
    c = _compiled()
    fn = getattr(c, fn)
    return fn(
        x,
        L["ln_in"],
        1e-5,
        L["wq"],
        L["bq"],
        L["wk"],
        None,
        L["wv"],
        None,
        None,
        None,
        0.0,
        0.0,
        cos,
        sin,
        1,
        x.shape[0],
        L["hq"],
        L["hkv"],
    )


def _attn_out(fn, L, x, q, k, v):
    c = _compiled()
    fn = getattr(c, fn)
    return fn(
        x,
        q,
        k,
        v,
        torch.empty(0, dtype=torch.bool),
        L["D"] ** -0.5,
        L["wo"],
        L["bo"],
        L["ln_post"],
        1e-5,
        L["wg"],
        None,
        L["wu"],
        None,
        L["wd"],
        L["bd"],
    )


def test_attn_in_and_attn_out_bf16_are_their_kernels_composed():
    # the bf16 layer halves run the same float32 steps as attn_in / attn_out around bf16 projections, with the
    # keys (after the rotation) and values rounded to bf16 as torch rounds: composing linear_bf16 with the float32
    # kernels gives the same bits (the residual adds included)
    c, L = _compiled(), _layer()
    T, past = 12, 5
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(T, L["W"], generator=gen)
    cos, sin = _rope_tables(T, L["D"])
    q, k, v = _attn_in("attn_in_bf16", L, x, cos, sin)
    h = c.rms_norm(x, L["ln_in"], 1e-5)
    q2 = c.rope(linear_bf16(h, L["wq"], L["bq"])[None], cos, sin, L["hq"])
    k2 = c.rope(linear_bf16(h, L["wk"])[None], cos, sin, L["hkv"])
    v2 = linear_bf16(h, L["wv"]).view(1, T, L["hkv"], L["D"]).transpose(1, 2)
    assert torch.equal(q, q2)
    assert not torch.equal(k, k2) and not torch.equal(v, v2)  # rounded: the float32 values are not bf16 ones
    assert torch.equal(k, k2.bfloat16().float()) and torch.equal(v, v2.bfloat16().float())
    assert torch.equal(k, _attn_in("attn_in_bf16", L, x, cos, sin)[1].bfloat16().float())  # idempotent
    assert not torch.equal(q, _attn_in("attn_in", L, x, cos, sin)[0])  # the float32 one differs
    rows = x[past:]
    out = _attn_out("attn_out_bf16", L, rows, q[:, :, past:], k, v)
    a = c.attention(q[:, :, past:], k, v, torch.empty(0, dtype=torch.bool), L["D"] ** -0.5).reshape(T - past, -1)
    x1 = rows + linear_bf16(a, L["wo"], L["bo"])
    hh = c.rms_norm(x1, L["ln_post"], 1e-5)
    s = c.silu_mul(linear_bf16(hh, L["wg"]), linear_bf16(hh, L["wu"]))
    assert torch.equal(out, x1 + linear_bf16(s, L["wd"], L["bd"]))


@pytest.mark.parametrize("ks", [(1, 2, 8, 9, 33)])
def test_attn_out_bf16_rows_are_invariant(ks):
    # queries past .. past + k - 1 over a cache of past + k keys: each row equals the row computed alone over
    # exactly the keys it sees (the attention, the bf16 projections and their residual adds)
    L = _layer(seed=1)
    past, n = 4, max(ks)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, L["W"], generator=gen)
    q = torch.randn(1, L["hq"], n, L["D"], generator=gen)
    k = torch.randn(1, L["hkv"], past + n, L["D"], generator=gen)
    v = torch.randn(1, L["hkv"], past + n, L["D"], generator=gen)
    alone = [
        _attn_out(
            "attn_out_bf16", L, x[i : i + 1], q[:, :, i : i + 1], k[:, :, : past + i + 1], v[:, :, : past + i + 1]
        )
        for i in range(n)
    ]
    for m in ks:
        block = _attn_out("attn_out_bf16", L, x[:m], q[:, :, :m], k[:, :, : past + m], v[:, :, : past + m])
        assert all(torch.equal(block[i], alone[i][0]) for i in range(m)), m


# ------------------------------------------------------------------------------------------ the packed copies
def test_bf16_copies_are_half_the_bytes_follow_updates_and_go_with_their_weights():
    compiled = _compiled()
    compiled.pack_release()
    x, weight, bias = _data(96, 96, rows=4)
    exact_linear(x, weight, bias)
    fp32 = compiled.pack_bytes()
    assert fp32 == 2 * 48 * 96 * 4
    first = linear_bf16(x, weight, bias)
    assert compiled.pack_bytes() == fp32 + fp32 // 2  # both copies counted; bf16 panels: half the bytes
    with torch.no_grad():
        weight.mul_(2.0)  # an in-place update re-packs the bf16 copy too
    assert torch.equal(linear_bf16(x, weight, bias), linear_bf16(x, weight.clone(), bias))
    assert not torch.equal(linear_bf16(x, weight, bias), first)
    del weight
    assert compiled.pack_bytes() == 0  # both copies of a freed weight are dropped
    y, w2, _ = _data(33, 10, rows=2)
    linear_bf16(y, w2)
    panel = 48 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 16  # the build's columns per panel
    assert compiled.pack_release() == panel * 17 * 2 * 2 and compiled.pack_bytes() == 0  # K = 33: 17 pairs


def test_attention_reads_bf16_keys_and_values_as_their_float32_values():
    # the exact-bf16 mode's KV cache holds bf16: attention and attention_segments over bf16 buffers give the bits
    # they give over float32 buffers holding the same (rounded) values, and not those of the unrounded values
    c = _compiled()
    gen = torch.Generator().manual_seed(4)
    hq, hkv, D, n, past = 6, 2, 64, 7, 33
    q = torch.randn(1, hq, n, D, generator=gen)
    k = torch.randn(1, hkv, past + n, D, generator=gen)
    v = torch.randn(1, hkv, past + n, D, generator=gen)
    k16, v16 = k.bfloat16(), v.bfloat16()
    scale, causal = D**-0.5, torch.empty(0, dtype=torch.bool)
    want = c.attention(q, k16.float(), v16.float(), causal, scale)
    assert torch.equal(c.attention(q, k16, v16, causal, scale), want)
    assert not torch.equal(c.attention(q, k, v, causal, scale), want)
    kb, vb = torch.zeros(3, hkv, 64, D, dtype=torch.bfloat16), torch.zeros(3, hkv, 64, D, dtype=torch.bfloat16)
    kb[2, :, : past + n], vb[2, :, : past + n] = k16[0], v16[0]
    got = c.attention_segments(q, kb, vb, [2], [past], [n], scale)
    assert torch.equal(got, want.reshape(n, hq * D))
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        c.attention(q, k16, v, causal, scale)
