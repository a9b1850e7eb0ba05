"""Kernel modes (`dspark_hf.kernels`): the exact mode's batch invariance, with negative controls.

The verification shape: `k` new tokens forwarded at once on top of a KV cache must give, row by row, the very
same logits (`torch.equal`) as the same tokens decoded one at a time on the same cache. The exact mode must
pass for every k in 2..16 on tiny Llama / Qwen2 / Qwen3 targets (fp32) and on the real default model; the
stock kernels and a deliberately batch-variant kernel (a split-K reduction for multi-row calls) must fail the
same check, which shows the check has the power to tell them apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import dspark_hf._transformers as tf
from dspark_hf import last_generation_stats
from dspark_hf.kernels import build, exact_linear, is_lean, kernels_of, lean_model, ops, packed, use_kernels

from helpers import make_aligned_draft, make_target

KS = range(2, 17)
CONTEXT = 21


def _target(arch: str):
    # fp32 (the exact kernels' dtype) and wide enough that the stock kernels' multi-row path differs
    return make_target(arch, vocab_size=512, hidden_size=128, num_layers=2, dtype=torch.float32)


@torch.no_grad()
def _prefilled(model, prompt):
    cache = DynamicCache(config=model.config)
    model(prompt, cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def identical_rows(model, ks=KS, context=CONTEXT, seed=0) -> dict[int, int]:
    """For each k: how many rows of a k-token forward on a cache equal decoding the k tokens one at a time."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    new = torch.randint(0, vocab, (1, max(ks)), generator=gen)
    cache = _prefilled(model, prompt)
    steps = [model(new[:, i : i + 1], cache=cache, use_cache=True).logits[0, 0] for i in range(max(ks))]
    counts = {}
    for k in ks:
        block = model(new[:, :k], cache=_prefilled(model, prompt), use_cache=True).logits[0]
        counts[k] = sum(torch.equal(block[i], steps[i]) for i in range(k))
    return counts


def _split_k_linear(x, weight, bias=None):
    """A deliberately batch-variant kernel: multi-row calls sum two half-K products (another reduction order)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        return exact_linear(x, weight, bias)
    half = x.shape[-1] // 2
    out = exact_linear(rows[:, :half], weight[:, :half]) + exact_linear(rows[:, half:], weight[:, half:], bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_exact_mode_rows_are_bit_identical_to_one_token_steps(arch):
    target = _target(arch)
    with use_kernels(target, mode="exact"):
        assert kernels_of(target) == "exact"
        assert all(is_lean(layer) for layer in target.model.layers)  # the lean decoder-layer path is what ran
        counts = identical_rows(target)
    assert counts == {k: k for k in KS}
    assert kernels_of(target) == "stock"  # restored after the block
    assert not any(is_lean(layer) for layer in target.model.layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_exact_mode_computes_what_the_stock_layers_compute(arch):
    # batch invariance alone would not catch a wrong formula (a rotation of the wrong half, a norm without its
    # weight): the exact mode's forward, lean layers included, must agree with transformers' own up to rounding
    target = _target(arch)
    gen = torch.Generator().manual_seed(3)
    prompt, new = torch.randint(0, 512, (1, CONTEXT), generator=gen), torch.randint(0, 512, (1, 8), generator=gen)
    with torch.no_grad():
        stock = target(new, cache=_prefilled(target, prompt)).logits
        with use_kernels(target, mode="exact"):
            exact = target(new, cache=_prefilled(target, prompt)).logits
            one = target(new[:, :1], cache=_prefilled(target, prompt)).logits
    assert not torch.equal(exact, stock)  # really another kernel path
    torch.testing.assert_close(exact, stock, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(one[0, 0], stock[0, 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [2, 3])
def test_exact_mode_is_invariant_to_the_thread_count(threads):
    # the suite's workers run on one thread (tests/conftest.py); the kernels split columns (linear) and queries
    # (attention) across threads, so check the split changes nothing: rows stay batch-invariant, and the logits
    # of a 16-token forward are bit-identical on 1 and on `threads` threads
    target, old = _target("llama"), torch.get_num_threads()
    prompt = torch.randint(0, 512, (1, CONTEXT + 16), generator=torch.Generator().manual_seed(1))
    try:
        with use_kernels(target, mode="exact"), torch.no_grad():
            torch.set_num_threads(1)
            one = target(prompt[:, CONTEXT:], cache=_prefilled(target, prompt[:, :CONTEXT])).logits
            torch.set_num_threads(threads)
            assert torch.get_num_threads() == threads
            many = target(prompt[:, CONTEXT:], cache=_prefilled(target, prompt[:, :CONTEXT])).logits
            counts = identical_rows(target, ks=(2, 8, 16))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)
    assert counts == {2: 2, 8: 8, 16: 16}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stock_kernels_fail_the_invariance_check(arch):
    counts = identical_rows(_target(arch))
    assert sum(counts.values()) < sum(KS) / 2, counts  # most rows differ in the last bits


def test_split_k_kernel_fails_the_invariance_check(monkeypatch):
    target = _target("llama")
    monkeypatch.setattr(ops, "exact_linear", _split_k_linear)
    with use_kernels(target, mode="exact"):
        counts = identical_rows(target, ks=(2, 8, 16))
    assert sum(counts.values()) < 13, counts


def test_packed_kernels_are_not_batch_invariant():
    if not packed.packing_available():
        pytest.skip("this torch build has no oneDNN packed linears")
    target = _target("llama")
    with use_kernels(target, mode="packed"):
        assert kernels_of(target) == "packed"
        counts = identical_rows(target, ks=(2, 8, 16))
    assert sum(counts.values()) < 13, counts


def test_pytorch_fallback_is_batch_invariant(monkeypatch):
    monkeypatch.setattr(build, "_BACKEND", False)  # as when no compiler is available
    assert build.exact_kernels_backend() == "torch"
    target = _target("qwen2")
    with use_kernels(target, mode="exact"):
        counts = identical_rows(target, ks=(2, 5, 16))
    assert counts == {2: 2, 5: 5, 16: 16}


@pytest.mark.parametrize("rows", [16, 150])  # 150: several of the kernel's row blocks (a prefill's shape)
@pytest.mark.parametrize("shape", [(576, 1536), (100, 37), (7, 5), (1536, 1)])
def test_exact_linear_rows_match_one_row_calls_and_the_product(shape, rows):
    k_in, n_out = shape
    torch.manual_seed(0)
    weight, bias, x = torch.randn(n_out, k_in), torch.randn(n_out), torch.randn(rows, k_in)
    full = exact_linear(x, weight, bias)
    assert all(torch.equal(exact_linear(x[i : i + 1], weight, bias)[0], full[i]) for i in range(rows))
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4 * k_in**0.5)
    # leading dims are kept
    assert exact_linear(x[:16].reshape(2, 8, k_in), weight).shape == (2, 8, n_out)


def test_exact_attention_matches_sdpa_and_respects_a_padding_mask():
    torch.manual_seed(0)
    batch, heads, kv_heads, q_len, kv_len, dim = 2, 4, 2, 5, 12, 16
    q = torch.randn(batch, heads, q_len, dim)
    k, v = torch.randn(batch, kv_heads, kv_len, dim), torch.randn(batch, kv_heads, kv_len, dim)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask = causal.expand(batch, 1, q_len, kv_len).clone()
    mask[1, :, :, :3] = False  # the second sequence is left-padded by 3
    module = torch.nn.Module()
    out, _ = ops.exact_attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # each query row equals the one-query call over the keys it sees
    for i in range(q_len):
        seen = kv_len - q_len + i + 1
        one, _ = ops.exact_attention_forward(
            module, q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], mask[:, :, i : i + 1, :seen], scaling=dim**-0.5
        )
        assert torch.equal(one[:, 0], out[:, i])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculative_greedy_is_token_identical_to_plain_decoding_in_exact_mode(arch):
    target = make_target(arch, markov=True, dtype=torch.float32)
    draft = make_aligned_draft(target, block_size=5)
    kw = {"max_new_tokens": 40, "do_sample": False, "dspark_kernels": "exact"}
    for seed in range(3):
        prompt = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, **kw)
        spec = target.generate(prompt, assistant_model=draft, dspark_policy="fixed", **kw)
        stats = last_generation_stats(draft)
        assert max(r.accepted for r in stats.rounds) >= 2  # some verification forwards accepted several tokens
        assert torch.equal(plain, spec)
    assert kernels_of(target) == "stock"


def test_the_call_mode_applies_to_plain_generate_and_bad_modes_are_refused(monkeypatch):
    target = _target("llama")
    seen = []
    original = ops.exact_linear
    monkeypatch.setattr(ops, "exact_linear", lambda *a, **k: seen.append(1) or original(*a, **k))
    prompt = torch.tensor([[1, 2, 3]])
    target.generate(prompt, max_new_tokens=2, do_sample=False, dspark_kernels="exact")
    assert seen  # plain generate() ran on the exact kernels
    seen.clear()
    target.generate(prompt, max_new_tokens=2, do_sample=False, dspark_kernels="stock")
    assert not seen  # and on the stock ones again: the mode lasts one call, nothing process-wide is left set
    assert kernels_of(target) == "stock"
    with pytest.raises(ValueError, match="Unknown kernel mode 'fast'.*'stock', 'packed', 'exact'"):
        with use_kernels(target, mode="fast"):
            pass
    with pytest.raises(ValueError, match="fast"):
        target.generate(prompt, max_new_tokens=2, dspark_kernels="fast")
    with pytest.raises(TypeError, match="mode='exact'"):  # the mode is a keyword, never taken for a model
        with use_kernels([target], "exact"):
            pass


def test_the_library_default_is_exact_for_a_float32_cpu_target_of_a_supported_family():
    from dspark_hf.kernels import default_kernels

    assert default_kernels(_target("llama")) == "exact"
    assert default_kernels(_target("qwen3")) == "exact"
    assert default_kernels(_target("llama").to(torch.bfloat16)) == "exact-bf16"  # its linears' GEMM in bf16
    assert default_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4))) == "stock"  # no supported decoder layer
    import dspark_hf

    assert not hasattr(dspark_hf, "set_kernels") and not hasattr(dspark_hf, "set_cpu_packing")  # one door only


@pytest.mark.real_model
def test_real_default_model_exact_mode_is_batch_invariant_and_stock_is_not(smollm):
    target, _ = smollm
    with use_kernels(target, mode="exact"):
        counts = identical_rows(target, context=37)
    assert counts == {k: k for k in KS}
    stock = identical_rows(target, ks=(2, 8, 16), context=37)
    assert sum(stock.values()) < 13, stock


def test_a_wrong_rotation_in_the_lean_layers_is_caught(monkeypatch):
    # negative control for the test above: rotary embedding by the opposite angle (sin negated) is still batch
    # invariant, but must not pass as what the stock layers compute
    real = build.backend()
    if real is None:
        pytest.skip("the compiled kernels are not available (the lean layer path needs them)")

    class WrongRotation:
        def __getattr__(self, name):
            return getattr(real, name)

        def attn_in(self, x, *args):  # the fused pre-attention call: (12 weights and constants), cos, sin, ...
            args = list(args)
            args[13] = -args[13]  # sin
            return real.attn_in(x, *args)

    monkeypatch.setattr(build, "_BACKEND", WrongRotation())
    with pytest.raises(AssertionError):
        test_exact_mode_computes_what_the_stock_layers_compute("llama")


def test_lean_layers_survive_transformers_output_capturing_hooks():
    # a speculative call asks the target for hidden states once, and transformers then keeps its capturing hooks
    # on every decoder layer and attention module for good; the lean path must still run (it fell back to the
    # transformers layers after the first speculative call: plain exact decoding 19.5 -> 14 tokens/s)
    target = _target("llama")
    with torch.no_grad():
        target(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert target.model.layers[0].self_attn._forward_hooks  # the hooks are there
    with use_kernels(target, mode="exact"):
        assert all(is_lean(layer) for layer in target.model.layers)
        with torch.no_grad():
            out = target(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert len(out.hidden_states) == target.config.num_hidden_layers + 1  # still captured through the layers


def test_the_drafts_functional_linears_follow_its_kernel_mode(monkeypatch):
    """The draft's subset LM head and Markov projection are functional linears: in the exact mode they run on
    the exact kernel (its 2-16-row speed), outside it on F.linear; the mode's swaps go when the block ends."""
    target = make_target("llama", markov=True, dtype=torch.float32)
    draft = make_aligned_draft(target, block_size=5)
    draft.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    hidden = torch.randn(1, 5, target.config.hidden_size)
    calls = []
    real = ops.exact_linear

    def counting(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(ops, "exact_linear", counting)
    with torch.no_grad():
        stock = draft.draft_logits(hidden)
        assert calls == []
        with use_kernels(target, draft, mode="exact"):
            with use_kernels(draft, mode="exact"):  # nested: the inner block leaves the outer one's swaps alone
                pass
            exact = draft.draft_logits(hidden)
            projected = draft.markov_head.project(torch.randn(5, draft.markov_head.rank), draft.draft_vocab_ids)
        assert len(calls) == 2 and calls[0] == (target.config.vocab_size // 2, target.config.hidden_size)
        assert projected.shape[-1] == target.config.vocab_size // 2
        torch.testing.assert_close(exact, stock, rtol=1e-5, atol=1e-5)  # same product, another summation order
        draft.draft_logits(hidden)
    assert len(calls) == 2  # back on F.linear
    assert not any("functional_linear" in m.__dict__ for m in (*draft.modules(), *target.modules()))


def _decode_sequence(target, prompt, new, hooked=()):
    """Prefill, three one-token steps, a 5-token verification, a crop of 3 (a rejected draft), a 4-token forward:
    the logits of each, the cache's keys and values at the end, the first layer's key pointers after each step,
    and what forward hooks on the layers `hooked` recorded."""
    from dspark_hf._transformers import recording_layers

    cache, logits, pointers = DynamicCache(config=target.config), [], set()
    with use_kernels(target, mode="exact"), torch.no_grad(), recording_layers(target, hooked) as recorder:
        recorded = []
        logits.append(target(prompt, cache=cache, use_cache=True).logits)
        for i in range(3):  # one token at a time
            logits.append(target(new[:, i : i + 1], cache=cache, use_cache=True).logits)
            pointers.add(cache.layers[0].keys.data_ptr())
            recorded.append(recorder.features() if recorder else None)
        logits.append(target(new[:, 3:8], cache=cache, use_cache=True).logits)  # a 5-token verification
        recorded.append(recorder.features() if recorder else None)
        cache.crop(-3)  # three of them rejected
        logits.append(target(new[:, 8:12], cache=cache, use_cache=True).logits)
        pointers.add(cache.layers[0].keys.data_ptr())
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return logits, kv, pointers, recorded


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_lean_layers_grow_the_cache_in_place_and_hold_what_concatenation_holds(arch, monkeypatch):
    # the lean path writes new keys/values into buffers with room to grow instead of transformers' torch.cat;
    # across decoding, verification, a crop (a rejected draft) and a prefill on the stock path, the cache must
    # hold exactly what concatenation holds, and the logits must be bit-identical
    target = _target(arch)
    gen = torch.Generator().manual_seed(5)
    prompt, new = torch.randint(0, 512, (1, CONTEXT), generator=gen), torch.randint(0, 512, (1, 12), generator=gen)
    grown, grown_kv, pointers, _ = _decode_sequence(target, prompt, new)
    assert len(pointers) == 1  # one buffer per layer, written in place after the prefill
    monkeypatch.setattr(tf, "dynamic_layer_room", lambda *args: None)  # every layer through the cache's own update
    concatenated, concatenated_kv, cat_pointers, _ = _decode_sequence(target, prompt, new)
    assert len(cat_pointers) > 1  # the control really concatenated (a new tensor every forward)
    assert _same(grown, concatenated) and _same(grown_kv, concatenated_kv)
    assert grown_kv[0][0].shape[2] == CONTEXT + 3 + 5 - 3 + 4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_layer_stack_runs_all_layers_in_one_call_and_matches_the_layer_by_layer_path(arch, monkeypatch):
    # in the exact mode a base model's lean layers run as one compiled call (stack_run) once the cache has
    # buffers; logits, cache and the outputs recorded for a DSpark draft (a forward hook on layer 0)
    # must be bit-identical to the layer-by-layer lean path, which must really be another path
    target = _target(arch)
    gen = torch.Generator().manual_seed(6)
    prompt, new = torch.randint(0, 512, (1, CONTEXT), generator=gen), torch.randint(0, 512, (1, 12), generator=gen)
    real, calls = build.backend(), []

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def stack_run(self, *args):
            calls.append(args[6])  # the tokens per sequence of that forward
            return real.stack_run(*args)

    monkeypatch.setattr(build, "_BACKEND", Counting())
    with use_kernels(target, mode="exact"):
        assert lean_model.is_lean_model(target.model)
    assert not lean_model.is_lean_model(target.model) and lean_model._LEAN_STACK not in target.model.__dict__
    stacked = _decode_sequence(target, prompt, new, hooked=(0,))
    assert calls == [1, 1, 1, 5, 4]  # every forward after the prefill (which fills the cache) was one call
    calls.clear()
    monkeypatch.setattr(lean_model, "_run_stack", lambda *args: None)
    layered = _decode_sequence(target, prompt, new, hooked=(0,))
    assert calls == []
    assert all(r is not None for r in stacked[3])
    assert _same(stacked[0], layered[0]) and _same(stacked[1], layered[1]) and _same(stacked[3], layered[3])


def test_the_layer_stack_leaves_a_forward_with_other_hooks_to_the_layers():
    # a hook that may read inputs or change outputs must run as a module hook: the stack steps aside
    target = _target("llama")
    seen = []
    handle = target.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(args[0].shape))
    try:
        with use_kernels(target, mode="exact"), torch.no_grad():
            cache = _prefilled(target, torch.tensor([[1, 2, 3, 4]]))
            target(torch.tensor([[5, 6]]), cache=cache, use_cache=True)
    finally:
        handle.remove()
    assert seen == [torch.Size([1, 4, 128]), torch.Size([1, 2, 128])]


def test_the_drafts_layers_run_the_compiled_layer_calls_and_match_their_pytorch_path():
    # in the exact mode a DSpark draft's Qwen3-style layers run the same two compiled calls as the target's (their
    # proposals are verified either way, so close is enough); a wrong rotation there must show
    from dspark_hf.decoding.caches import KVStore
    from dspark_hf.decoding.drafting import draft_block, ingest

    target = make_target("llama", markov=True, dtype=torch.float32)
    draft = make_aligned_draft(target, block_size=5, num_layers=2)
    torch.nn.init.normal_(draft.norm.weight)  # the aligned helper zeroes it; the backbone's output must show here
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(9, draft.fc.in_features, generator=gen)
    anchors = torch.tensor([3])

    def backbone():
        store = KVStore(64)
        with torch.no_grad():
            ingest(draft, [store], [features])
            return draft_block(draft, [store], anchors)[0]

    reference = backbone()
    with use_kernels(target, draft, mode="exact"):
        assert all(is_lean(layer) for layer in draft.layers)
        lean = backbone()
    assert not any(is_lean(layer) for layer in draft.layers)
    torch.testing.assert_close(lean, reference, rtol=1e-4, atol=1e-4)
    real = build.backend()

    class WrongRotation:
        def __getattr__(self, name):
            return getattr(real, name)

        def attn_in(self, x, *args):
            args = list(args)
            args[13] = -args[13]  # sin
            return real.attn_in(x, *args)

    build._BACKEND = WrongRotation()
    try:
        with use_kernels(target, draft, mode="exact"):
            wrong = backbone()
    finally:
        build._BACKEND = real
    assert not torch.allclose(wrong, reference, rtol=1e-4, atol=1e-4)
