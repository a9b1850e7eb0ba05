"""Packed CPU linears (`dspark_hf.kernels.packed`): same function, used only where intended, always restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GenerationConfig

import dspark_hf
from dspark_hf import last_generation_stats
from dspark_hf.kernels import default_kernels, kernels_of, use_kernels
from dspark_hf.kernels import packed as cpu_packing
from dspark_hf.kernels.packed import (
    _bf16_packing_supported,
    is_packed,
    pack_linear_weights,
    packed_linears,
    packing_available,
    unpack_linear_weights,
)

from helpers import make_aligned_draft, make_target

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed linears")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 7), (3, 5), (33,)])
def test_packed_forward_equals_stock(dtype, shape):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80).to(dtype)
    x = torch.randn(*shape, 48, dtype=dtype)
    expected = layer(x)
    packs = dtype == torch.float32 or _bf16_packing_supported()  # bf16 packing needs AVX-512 or AVX-NE-CONVERT
    with torch.no_grad(), packed_linears(layer, enabled=True) as changed:
        assert changed == ([layer] if packs else []) and is_packed(layer) == packs
        got = layer(x)
    assert not is_packed(layer)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected.detach(), rtol=tol, atol=tol)


def test_packed_weight_follows_weight_updates():
    """An in-place update or a replaced weight rebuilds the packed copy (a stale copy would be a silent bug)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 24, bias=False)
    x = torch.randn(4, 16)
    with torch.no_grad(), packed_linears(layer, enabled=True):
        before = layer(x)
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), 2 * before)
        layer.weight = nn.Parameter(torch.zeros(24, 16))
        assert torch.count_nonzero(layer(x)) == 0


def test_large_inputs_use_the_stock_kernel(monkeypatch):
    """A prefill-sized input (more than PACKED_MAX_ROWS rows) runs the stock kernel, a small one the packed one."""
    calls = []
    packed_matmul = cpu_packing._packed_matmul
    monkeypatch.setattr(cpu_packing, "_packed_matmul", lambda *a: calls.append(a[0].shape) or packed_matmul(*a))
    torch.manual_seed(0)
    layer = nn.Linear(32, 40)
    limit = cpu_packing.PACKED_MAX_ROWS
    with torch.no_grad(), packed_linears(layer, enabled=True):
        big = torch.randn(1, limit + 1, 32)
        torch.testing.assert_close(layer(big), nn.functional.linear(big, layer.weight, layer.bias))
        assert calls == []
        layer(torch.randn(1, limit, 32))
        assert calls == [(1, limit, 32)]


def test_gradients_use_the_stock_kernel():
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    with packed_linears(layer, enabled=True):
        layer(torch.randn(3, 8)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_only_plain_cpu_float_linears_are_packed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Embedding(10, 4))
    with packed_linears(model, enabled=True) as changed:
        assert changed == [model[0]]
    assert not any(is_packed(m) for m in model)


def test_disabled_packs_nothing():
    layer = nn.Linear(4, 4)
    with packed_linears(layer, enabled=False) as changed:
        assert changed == [] and not is_packed(layer)


def test_off_by_default_and_the_packed_mode_enables():
    # packing is never the library's default (it is not batch-invariant); only naming the mode turns it on
    target = make_target("llama", vocab_size=96, dtype=torch.float32)
    assert default_kernels(target) != "packed"
    assert kernels_of(target) == "stock"
    with use_kernels(target, mode="packed"):
        assert kernels_of(target) == "packed"
    assert kernels_of(target) == "stock"


def test_pack_and_unpack_persist_until_undone():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    changed = pack_linear_weights(model)
    assert len(changed) == 2 and all(is_packed(m) for m in changed)
    with packed_linears(model, enabled=True) as inner:  # already packed: left alone, still packed after
        assert inner == []
    assert all(is_packed(m) for m in changed)
    unpack_linear_weights(model)
    assert not any(is_packed(m) for m in changed) and "_dspark_packed" not in model[0].__dict__


def _packed_calls(model):
    """Count forwards of `model`'s linears that ran packed / unpacked (forward pre-hooks)."""
    counts = {"packed": 0, "stock": 0}

    def hook(module, args):
        counts["packed" if is_packed(module) else "stock"] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    return counts, handles


def test_speculative_generate_packs_and_is_exact_in_fp32():
    """fp32 target (packing applies): greedy speculative output equals plain greedy output on 12 prompts, the
    verification forwards ran packed, plain generate() did not, and nothing stays packed afterwards."""
    target = make_target("llama", vocab_size=96, markov=True, dtype=torch.float32)
    draft = make_aligned_draft(target, "markov").float()
    gen = torch.Generator().manual_seed(7)
    counts, handles = _packed_calls(target)
    try:
        taus = []
        for i in range(12):
            ids = torch.randint(0, 96, (1, 3 + 2 * i), generator=gen)
            plain = target.generate(ids, max_new_tokens=24, do_sample=False, dspark_kernels="stock")
            assert counts["packed"] == 0, "plain generate() must not be changed"
            stock_calls = counts["stock"]
            config = GenerationConfig(do_sample=False, max_new_tokens=24, dspark_policy="fixed")
            out = target.generate(ids, generation_config=config, assistant_model=draft, dspark_kernels="packed")
            assert torch.equal(out, plain), f"prompt {i}: packed speculative output differs"
            assert counts["stock"] == stock_calls and counts["packed"] > 0
            counts["packed"] = 0
            taus.append(last_generation_stats(draft).tau)
    finally:
        for h in handles:
            h.remove()
    assert sum(taus) / len(taus) > 2.0  # the multi-token verification path really ran
    assert not any(is_packed(m) for m in target.modules()) and not any(is_packed(m) for m in draft.modules())


def test_engine_packs_in_its_steps():
    target = make_target("llama", vocab_size=96, markov=True, dtype=torch.float32)
    draft = make_aligned_draft(target, "markov").float()
    counts, handles = _packed_calls(target)
    try:
        engine = dspark_hf.DSparkEngine(target, draft, policy="fixed", max_batch_size=4, kernels="packed")
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
        outs = engine.generate(prompts, dspark_hf.SamplingParams(max_new_tokens=12))
        assert counts["packed"] > 0 and counts["stock"] == 0
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            plain = target.generate(ids, max_new_tokens=12, do_sample=False, dspark_kernels="stock")
            assert out.token_ids == plain[0, len(prompt) :].tolist()
        off = dspark_hf.DSparkEngine(target, draft, policy="fixed", max_batch_size=4, kernels="stock")
        counts["packed"] = 0
        off.generate(prompts[:1], dspark_hf.SamplingParams(max_new_tokens=4))
        assert counts["packed"] == 0
    finally:
        for h in handles:
            h.remove()
