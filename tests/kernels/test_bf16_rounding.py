"""The exact-bf16 mode's rounding of keys and values (`round_to_bf16_`, and the same steps where the layer stack
writes bf16 slots) equals torch's float32 -> bfloat16 conversion on every float32: round to nearest even,
denormals kept, infinities and overflow to infinity, NaN stays NaN. The AVX-512 build runs it 16 lanes at a time
and the scalar steps on the tail, so lengths that are not multiples of 16 check both."""

from __future__ import annotations

import pytest
import torch

from dspark_hf.kernels import build

pytestmark = pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here")


def _edge_cases() -> torch.Tensor:
    bits = [
        0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x00007FFF,  # zeros, denormals, ties
        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,  # ties to even both ways, just below and above a tie
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # the largest floats: round to inf, or not
        0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FBFFFFF,  # infinities, quiet and signalling NaN
    ]  # fmt: skip
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("n", [21, 4096 + 7, 1_000_003])
def test_round_to_bf16_equals_torchs_conversion_on_any_bits(n):
    gen = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    x[: len(_edge_cases())] = _edge_cases()
    expected = x.to(torch.bfloat16).float()
    got = x.clone()
    build.backend().round_to_bf16_(got)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    assert nan.sum() > 0 and (x.abs() < torch.finfo(torch.float32).tiny).sum() > 0  # NaNs and denormals were in it
    # control: truncating instead of rounding differs
    truncated = (x.view(torch.int32) & -65536).view(torch.float32)
    assert not torch.equal(truncated[~nan].view(torch.int32), expected[~nan].view(torch.int32))
