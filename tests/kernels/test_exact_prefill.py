"""A long prefill on the exact kernels: one shot, in chunks of any sizes, or token by token, bit for bit the same.

Every exact kernel computes an output row by one fixed sequence of operations over that row's own inputs (the
linears' fma chain over k, the attention's reduction over the keys the query may see, in ascending order), at any
number of rows. So the prefill of a prompt longer than any chunk the engine runs is the same computation however
it is cut: one forward over all its tokens (what `generate()` runs), consecutive chunks each attending to the
cached keys and causally to itself (what the engine's chunked prefill runs, with any chunk sizes), or one token at
a time (plain decoding). Logits and every layer's keys and values must be `torch.equal` across the three, for a
prompt longer than 512 tokens (the length up to which the exact mode used to run, the stock kernels beyond). The
stock kernels must fail the same check, which shows it has the power to tell.

The attention kernel scores queries in groups of four against four keys at a time and scores only the keys up to a
query's last visible one: every query of a many-query call (full and partial groups, causal or masked, padded rows
with no visible key, head dimensions on and off the vector width) must equal the one-query call over the keys it
sees, and torch's SDPA must fail that check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dspark_hf.kernels import build, is_lean_model, use_kernels
from dspark_hf.kernels.ops import NO_MASK

from helpers import make_target

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here"),
]

LENGTH = 700  # longer than 512
CHUNKINGS = ([LENGTH], [512, 188], [1, 99, 300, 300], [64] * 10 + [60])


def _target(arch: str = "llama"):
    # fp32 (the exact kernels' dtype), wide enough that the stock kernels' multi-row paths round differently
    return make_target(
        arch, vocab_size=256, hidden_size=128, num_layers=2, dtype=torch.float32, max_position_embeddings=1024
    )


def _prompt(length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _chunked(target, ids: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of every position and the cache's keys and values, prefilling `ids` in chunks of `sizes`."""
    assert sum(sizes) == ids.shape[1]
    cache = DynamicCache(config=target.config)
    logits, at = [], 0
    for n in sizes:
        logits.append(target(input_ids=ids[:, at : at + n], cache=cache, use_cache=True).logits)
        at += n
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return torch.cat(logits, dim=1), kv


def _differences(target, mode: str, chunkings=CHUNKINGS, one_by_one: bool = True) -> list[str]:
    ids = _prompt()
    with use_kernels(target, mode=mode):
        if mode == "exact":
            assert is_lean_model(target.model)
        runs = {tuple(sizes): _chunked(target, ids, sizes) for sizes in chunkings}
        if one_by_one:
            runs[(1,) * LENGTH] = _chunked(target, ids, [1] * LENGTH)
    (whole_logits, whole_kv), *_ = runs.values()
    bad = []
    for sizes, (logits, kv) in runs.items():
        name = f"chunks {list(sizes[:4])}{'...' if len(sizes) > 4 else ''}"
        if not torch.equal(logits, whole_logits):
            bad.append(f"{name}: logits")
        bad += [f"{name}: kv {i}" for i, (a, b) in enumerate(zip(kv, whole_kv)) if not torch.equal(a, b)]
    return bad


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_exact_prefill_is_the_same_in_one_shot_in_chunks_and_token_by_token(arch):
    target = _target(arch)
    assert _differences(target, "exact") == []


def test_exact_prefill_of_a_long_prompt_runs_the_exact_kernels():
    # the whole prompt through the lean model's compiled stack, not a fallback to the stock kernels: the one-shot
    # exact prefill differs from the stock one (the stock kernels round differently)
    target = _target()
    ids = _prompt()
    with torch.no_grad():
        stock = target(ids).logits
        with use_kernels(target, mode="exact"):
            exact = target(ids).logits
    assert not torch.equal(stock, exact)
    torch.testing.assert_close(stock, exact, rtol=1e-4, atol=1e-4)


def test_stock_prefill_fails_the_same_check():
    # negative control: the stock kernels' chunked prefill rounds differently from the one-shot one
    target = _target()
    assert _differences(target, "stock", chunkings=CHUNKINGS[:3], one_by_one=False)


def _attention_row_mismatches(attention, dim: int, q_len: int, past: int, masked: bool) -> int:
    """Queries of one `q_len`-query call that differ from the one-query call over the keys they see."""
    gen = torch.Generator().manual_seed(q_len * 31 + past + dim)
    kv_len = past + q_len
    q = torch.randn(2, 4, q_len, dim, generator=gen)
    k, v = torch.randn(2, 2, kv_len, dim, generator=gen), torch.randn(2, 2, kv_len, dim, generator=gen)
    mask = None
    if masked:  # causal, the second sequence left-padded by 3, its first query sees nothing at all
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(past).expand(2, 1, q_len, kv_len).clone()
        mask[1, :, :, :3] = False
        mask[1, :, 0] = False
    full = attention(q, k, v, mask)
    bad = 0
    for i in range(q_len):
        seen = past + i + 1
        row_mask = None if mask is None else mask[:, :, i : i + 1, :seen]
        one = attention(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], row_mask)
        bad += not torch.equal(one[:, :, 0], full[:, :, i])
    return bad


def _exact_attention(q, k, v, mask):
    out = build.backend().attention(q, k, v, NO_MASK if mask is None else mask, 0.3)  # [B, L, H, D]
    return out.transpose(1, 2)


def _sdpa(q, k, v, mask):
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).nan_to_num(0.0)


@pytest.mark.parametrize("dim", [64, 20])
@pytest.mark.parametrize("masked", [False, True])
def test_exact_attention_queries_of_a_many_query_call_equal_one_query_calls(dim, masked):
    for q_len, past in [(1, 0), (3, 5), (4, 0), (5, 9), (9, 0), (37, 13), (130, 0)]:
        assert _attention_row_mismatches(_exact_attention, dim, q_len, past, masked) == 0, (q_len, past)


def test_sdpa_fails_the_attention_check():
    # negative control: torch's SDPA computes a many-query call differently from one-query calls
    bad = sum(_attention_row_mismatches(_sdpa, 64, q_len, 13, False) for q_len in (9, 37, 130))
    assert bad > 0


def _per_row_calls(dtype):
    """Attention of a causal chunk (both entry points: its units go to the threads by cost), RMSNorm and the rotation
    of a prefill-sized call (split over the threads from ~57 rows), on fixed random inputs."""
    gen = torch.Generator().manual_seed(5)
    compiled = build.backend()
    q = torch.randn(1, 4, 300, 64, generator=gen)
    k, v = (torch.randn(1, 2, 340, 64, generator=gen).to(dtype) for _ in range(2))
    kbuf, vbuf = (torch.randn(3, 2, 400, 64, generator=gen).to(dtype) for _ in range(2))
    x, w = torch.randn(300, 576, generator=gen), torch.randn(576, generator=gen)
    xr, cos, sin = torch.randn(1, 300, 4 * 64, generator=gen), *torch.randn(2, 1, 300, 64, generator=gen)
    return [
        compiled.attention(q, k, v, NO_MASK, 0.125),
        compiled.attention_segments(q, kbuf, vbuf, [2, 0, 1], [90, 0, 7], [1, 280, 19], 0.125),
        compiled.rms_norm(x, w, 1e-5),
        compiled.rope(xr, cos, sin, 4),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_changes_no_bit_of_the_per_row_kernels(dtype):
    old = torch.get_num_threads()
    try:
        runs = {}
        for threads in (1, 2, 3):  # 3: uneven splits
            torch.set_num_threads(threads)
            runs[threads] = _per_row_calls(dtype)
    finally:
        torch.set_num_threads(old)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[threads])), threads
