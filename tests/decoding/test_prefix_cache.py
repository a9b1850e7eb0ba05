"""The engine's prefix cache: prompts that begin like earlier ones copy that beginning's keys, values and target
features instead of prefilling it, and the output does not change.

On the exact kernels a token's keys, values and features depend only on the tokens up to it, so a request whose
beginning is restored must give plain exact decoding's output of its prompt alone: the same tokens and, stronger,
bit-identical logits (its first token's and every committed row's after it), with and without a draft, in both
exact modes, while the hit counter shows the cache was read. Controls with power: a cache whose blocks are
perturbed by one bf16 step fails the logits check (the restored values are what the requests attend to), and the
workload's shapes make the hits cover blocks that end mid-chunk, prompts that are whole blocks long (the last
token is always prefilled), a prompt repeated, and one that is another's beginning.
"""

from __future__ import annotations

import pytest
import torch
from test_chunked_prefill import _mismatches, _run, _slots_in_order

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf._transformers import forward_with_features
from dspark_hf.decoding.caches import SlotKV
from dspark_hf.decoding.prefix_cache import PREFIX_BLOCK, PrefixCache, PrefixProgress
from dspark_hf.kernels import build, use_kernels

from helpers import make_aligned_draft, make_target

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here"),
]

VOCAB = 512
BUDGET = 48  # prompt tokens per round: chunk ends fall inside blocks


def _workload():
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(0, VOCAB, (37,), generator=gen).tolist()  # a "system message": 4 blocks and 5 tokens

    def tail(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    first = system + tail(150)
    prompts = [
        first,
        system + tail(60),
        system + tail(3),
        first,  # repeated: all but its last partial block restored
        first[:96],  # whole blocks long, another's beginning: its last block is prefilled (its last token's logits)
        system + tail(200),
        tail(20),  # nothing in common
        system[:5],  # shorter than a block
    ]
    return [(p, n) for p, n in zip(prompts, [10, 12, 9, 11, 8, 10, 7, 9])]


def _references(target, work, kernels):
    refs = []
    for prompt, m in work:
        out = target.generate(
            torch.tensor([prompt]), max_new_tokens=m, do_sample=False, dspark_kernels=kernels,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        refs.append((out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]))
    return refs


@pytest.fixture(scope="module")
def setup():
    target = make_target(
        "llama", vocab_size=VOCAB, hidden_size=128, num_layers=2, markov=True, dtype=torch.float32,
        max_position_embeddings=1024,
    )  # fmt: skip
    work = _workload()
    return target, work, {k: _references(target, work, k) for k in ("exact", "exact-bf16")}


def _engine(target, draft, kernels, **kwargs):
    if draft is None:
        return DSparkEngine(
            target, None, policy="none", max_batch_size=3, kernels=kernels, max_prefill_tokens=BUDGET, **kwargs
        )
    return DSparkEngine(target, draft, policy="fixed", max_batch_size=3, kernels=kernels, max_prefill_tokens=BUDGET)


@pytest.mark.parametrize(("kernels", "draft"), [("exact", "none"), ("exact", "aligned"), ("exact-bf16", "none")])
def test_requests_restored_from_the_prefix_cache_give_plain_exact_decoding(setup, kernels, draft):
    target, work, refs = setup
    model = make_aligned_draft(target, "markov", block_size=4) if draft == "aligned" else None
    engine = _engine(target, model, kernels)
    assert engine.prefix_cache is not None  # on by default on the exact kernels
    results = _run(engine, work, checks=_slots_in_order)
    wrong, differ, compared = _mismatches(results, refs[kernels])
    assert wrong == 0 and differ == 0, (wrong, differ, compared)
    assert compared >= sum(n for _, n in work)
    m = engine.metrics
    lengths = [len(p) for p, _ in work]
    assert m.prefix_cache_queried_tokens == sum(lengths)
    assert m.prefix_cache_hit_tokens + m.prefill_tokens == sum(lengths)
    # at least: the system message's 4 whole blocks for the requests that join after the first one's first chunk,
    # and the repeated prompt's 23 blocks
    assert m.prefix_cache_hit_tokens >= 4 * 32 + 184, m.prefix_cache_hit_tokens
    assert 0 < m.prefix_cache_bytes == engine.prefix_cache.nbytes
    if model is not None:
        assert m.drafting_rounds > 5 and m.drafts_accepted > 0


def test_a_perturbed_cache_fails_the_logits_check(setup, monkeypatch):
    # negative control: every block the cache hands out is one bf16 step off; the restored beginnings are what the
    # requests attend to, so their logits (and here tokens) change
    target, work, refs = setup
    restore = PrefixCache.restore

    def perturbed(self, prompt, store, slot):
        for block in self._blocks.values():
            block.kv.mul_(1 + 2**-7)
        return restore(self, prompt, store, slot)

    monkeypatch.setattr(PrefixCache, "restore", perturbed)
    engine = _engine(target, None, "exact")
    wrong, differ, _ = _mismatches(_run(engine, work), refs["exact"])
    assert engine.metrics.prefix_cache_hit_tokens > 0
    assert differ > 0, differ


def test_restored_features_equal_the_one_shot_prefill(setup):
    # the draft's pending features of a restored prompt: the cached blocks' then the prefilled chunks', in order
    target, work, _ = setup
    draft = make_aligned_draft(target, "none", block_size=4)
    engine = _engine(target, draft, "exact")
    seen = {}

    def grab(engine):
        for req in engine._active:
            if req.prefilled == len(req.prompt) and len(req.tokens) == 1 and req.rid not in seen:
                seen[req.rid] = (req.prompt, torch.cat(req.draft.pending), req.prefix.cached)

    _run(engine, work, checks=grab)
    assert len(seen) == len(work) and sum(cached > 0 for _, _, cached in seen.values()) >= 4
    with torch.no_grad(), use_kernels(target, mode="exact"):
        for prompt, features, _ in seen.values():
            _, expected = forward_with_features(target, engine.layer_ids, torch.tensor([prompt]))
            assert torch.equal(features, expected[0]), len(prompt)


def test_the_cache_is_off_elsewhere_and_can_be_emptied(setup):
    target, work, _ = setup
    assert DSparkEngine(target, None, policy="none", kernels="stock").prefix_cache is None
    assert DSparkEngine(target, None, policy="none", kernels="exact", prefix_cache_bytes=0).prefix_cache is None
    with pytest.raises(ValueError, match="exact kernels only"):
        DSparkEngine(target, None, policy="none", kernels="stock", prefix_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        DSparkEngine(target, None, policy="none", kernels="exact", prefix_cache_bytes=-1)
    engine = _engine(target, None, "exact")
    prompt = work[0][0]
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
    assert engine.prefix_cache.tokens == len(prompt) // PREFIX_BLOCK * PREFIX_BLOCK
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
    hits = engine.metrics.prefix_cache_hit_tokens
    assert hits == (len(prompt) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    assert engine.reset_prefix_cache() and len(engine.prefix_cache) == 0 and engine.metrics.prefix_cache_bytes == 0
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
    assert engine.metrics.prefix_cache_hit_tokens == hits  # nothing left to hit
    engine.release_kernels()


def _store_with(tokens: int, value: float = 1.0) -> SlotKV:
    store = SlotKV(2)
    store.add("a")
    store.reserve(tokens, like=[(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))] * 3)
    for i in range(3):
        store._keys[i][0, :, :tokens] = torch.arange(tokens, dtype=torch.float32)[None, :, None] + i
        store._values[i][0, :, :tokens] = -value * torch.arange(tokens, dtype=torch.float32)[None, :, None]
    store.lengths[0] = tokens
    return store


def test_blocks_are_keyed_by_everything_before_them_and_evicted_from_chain_ends():
    block_bytes = 2 * 3 * 2 * PREFIX_BLOCK * 4 * 4  # keys and values of 3 layers, 2 heads, 8 tokens, dim 4, fp32
    cache = PrefixCache(max_bytes=5 * block_bytes)
    a = list(range(100, 100 + 4 * PREFIX_BLOCK))
    store = _store_with(len(a))
    progress = PrefixProgress()
    cache.extend(progress, a, len(a), store, 0)
    assert len(cache) == 4 and progress.cached == len(a) and cache.nbytes == 4 * block_bytes
    # the same block of tokens after another beginning is another block
    target = SlotKV(2)
    target.add("b")
    other = [7] * PREFIX_BLOCK + a[PREFIX_BLOCK:] + [1]
    got, _ = cache.restore(other, target, 0)
    assert got.cached == 0 and not target.allocated
    # a prompt that is a's first three blocks and a bit: three blocks back, values as written
    prompt = a[: 3 * PREFIX_BLOCK] + [5, 6]
    got, features = cache.restore(prompt, target, 0)
    assert got.cached == 3 * PREFIX_BLOCK and features is None and target.lengths[0] == got.cached
    for i in range(3):
        k, v = target.layer(0, i)
        ref_k, ref_v = store.layer(0, i)
        assert torch.equal(k, ref_k[:, : got.cached]) and torch.equal(v, ref_v[:, : got.cached])
    # two more blocks after a's second: the budget holds five, so a's least recently used block goes, and that is
    # its last one (a chain's parents are always more recent than it), never a parent of a live block
    b = a[: 2 * PREFIX_BLOCK] + list(range(300, 300 + 2 * PREFIX_BLOCK))
    store_b = _store_with(len(b), value=2.0)
    cache.extend(PrefixProgress(), b, len(b), store_b, 0)
    assert len(cache) == 5 and cache.nbytes == 5 * block_bytes
    assert cache.restore(a + [0], _empty(), 0)[0].cached == 3 * PREFIX_BLOCK
    assert cache.restore(b + [0], _empty(), 0)[0].cached == len(b)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.restore(a + [0], _empty(), 0)[0].cached == 0


def _empty() -> SlotKV:
    store = SlotKV(1)
    store.add("x")
    return store
