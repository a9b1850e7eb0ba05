"""The engine's chunked prefill: long prompts ingested over several rounds, interleaved with decoding, exactly.

Each round gives the prefilling requests at most `max_prefill_tokens` prompt tokens (oldest first); a chunk
attends to its request's cached keys and causally to itself. On the exact kernels that is the same computation as
plain decoding's one-shot prefill (`tests/kernels/test_exact_prefill.py`), so under concurrency, with short and
long prompts (some longer than 512 tokens, one over 1,000) and a chunk budget small enough that the tiny target
runs dozens of chunks, every request's greedy output must be token-identical to plain exact `generate()` of its
prompt alone, and stronger, its target logits bit-identical (`torch.equal`): the first token's (the last chunk's)
and every committed row's after it; without speculation, with an aligned draft, and with a random one. The draft's
pending features of a prompt (appended chunk by chunk) must equal the one-shot prefill's features bit for bit.
Controls with power: the stock kernels fail the logits check, and a broken chunking (a chunk that does not see its
request's earlier chunks) fails even the token check; the chunk counter shows the chunked path ran.
"""

from __future__ import annotations

import pytest
import torch

import dspark_hf.decoding.engine as engine_module
from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf._transformers import forward_with_features
from dspark_hf.decoding.caches import SlotKV
from dspark_hf.kernels import build, kernels_of, use_kernels

from helpers import make_aligned_draft, make_target, record_committed_logits, run_joining

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here"),
]

VOCAB = 512
BUDGET = 64  # prompt tokens per round: the 1,100-token prompt takes 18 chunks
LENGTHS = [5, 700, 40, 1100, 3, 530, 90]
NEWS = [12, 9, 16, 8, 14, 10, 11]


def _target(arch: str = "llama"):
    # fp32 (the exact kernels' dtype), wide enough that the stock kernels round differently, Markov-like so an
    # aligned draft is often right; a context long enough for the long prompts
    return make_target(
        arch, vocab_size=VOCAB, hidden_size=128, num_layers=2, markov=True, dtype=torch.float32,
        max_position_embeddings=2048,
    )  # fmt: skip


def _workload():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), m) for n, m in zip(LENGTHS, NEWS)]


def _references(target, work):
    """Plain exact decoding of each prompt alone (one-shot prefill): tokens and the logits of every step."""
    refs = []
    for prompt, m in work:
        out = target.generate(
            torch.tensor([prompt]), max_new_tokens=m, do_sample=False, dspark_kernels="exact",
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        refs.append((out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]))
    return refs


def _run(engine, work, checks=None, shared=None):
    """Two requests first, then one joining before every round. Per request: tokens, the logits of its first token
    (its last prefill chunk's) and of every committed row after it; `checks(engine)` runs after every round.
    `shared` (a list) gets one entry per forward that carried decoding rows and prefill chunks together."""
    prefill_logits: dict[int, torch.Tensor] = {}
    ragged, varlen = engine_module.ragged_target_forward, engine_module.varlen_target_forward

    def record(rows_of, new_tokens, out):
        for (store, slot), tokens, logits in zip(rows_of, new_tokens, out.logits):
            req = store.owners[slot]
            if req.prefilled + len(tokens) == len(req.prompt):  # the last chunk: the first token's logits
                prefill_logits[req.rid] = logits[-1].clone()
        return out

    def recording_ragged(target, stores, new_tokens, keep, *args, **kwargs):
        out = ragged(target, stores, new_tokens, keep, *args, **kwargs)
        return record([(s.store, s.slot) for s in stores], new_tokens, out)

    def recording_varlen(target, stack, store, slots, new_tokens, keep, *args, **kwargs):
        out = varlen(target, stack, store, slots, new_tokens, keep, *args, **kwargs)
        prefill = [store.owners[s].prefilled < len(store.owners[s].prompt) for s in slots]
        if shared is not None and any(prefill) and not all(prefill):
            shared.append(len(slots))
        return record([(store, s) for s in slots], new_tokens, out)

    rows = record_committed_logits(engine)
    engine_module.ragged_target_forward, engine_module.varlen_target_forward = recording_ragged, recording_varlen
    try:
        ids, outputs = run_joining(engine, work, first=2, after_step=checks)
    finally:
        engine_module.ragged_target_forward, engine_module.varlen_target_forward = ragged, varlen
    return [(outputs[i].token_ids, prefill_logits.get(i), rows.get(i, [])) for i in ids]


def _mismatches(results, refs) -> tuple[int, int, int]:
    """(requests whose tokens differ, logit rows that are not bit-identical, rows compared)."""
    wrong = differ = compared = 0
    for (tokens, first, rows), (ref_tokens, ref_logits) in zip(results, refs):
        wrong += tokens != ref_tokens
        steps = [first, *rows]
        differ += sum(not torch.equal(a, b) for a, b in zip(steps, ref_logits))
        compared += min(len(steps), len(ref_logits))
    return wrong, differ, compared


def _slots_in_order(engine):
    """The decoding requests hold slots 0..R-1 of both stores (the rows of the round's forwards), prefilling ones
    the slots after them."""
    decoding = [r for r in engine._active if r.prefilled == len(r.prompt)]
    assert [r.kv.slot for r in engine._active] == list(range(len(engine._active)))
    assert [r.kv.slot for r in decoding] == list(range(len(decoding)))
    assert all(r.dkv is None or r.dkv.slot == r.kv.slot for r in engine._active)
    assert all(len(r.kv) == r.prefilled + max(0, len(r.tokens) - 1) for r in decoding)
    assert all(len(r.kv) == r.prefilled for r in engine._active if r not in decoding)
    # the draft's context plus the features it has not ingested yet cover exactly what the target committed
    assert all(r.dkv is None or len(r.dkv) + r.pending_tokens == len(r.kv) for r in engine._active)


@pytest.fixture(scope="module")
def setup():
    target = _target()
    work = _workload()
    return target, work, _references(target, work)


@pytest.mark.parametrize("draft", ["none", "aligned", "random"])
def test_chunked_prefill_under_concurrency_equals_plain_exact_decoding(setup, draft):
    target, work, refs = setup
    if draft == "none":
        engine = DSparkEngine(target, None, policy="none", max_batch_size=4, kernels="exact", max_prefill_tokens=BUDGET)
    else:
        model = make_aligned_draft(target, "markov" if draft == "aligned" else "none", block_size=4)
        engine = DSparkEngine(
            target, model, policy="fixed", max_batch_size=4, kernels="exact", max_prefill_tokens=BUDGET
        )
    shared = []
    results = _run(engine, work, checks=_slots_in_order, shared=shared)
    wrong, differ, compared = _mismatches(results, refs)
    assert wrong == 0 and differ == 0, (wrong, differ, compared)
    assert len(shared) >= 10  # most chunks rode in a decoding round's forward
    assert compared >= sum(NEWS)
    m = engine.metrics
    assert m.prefill_tokens == sum(LENGTHS)
    assert m.prefill_chunks >= sum(-(-n // BUDGET) for n in LENGTHS) > 2 * len(LENGTHS)  # the chunked path ran
    assert m.prefill_forwards >= -(-sum(LENGTHS) // BUDGET)
    assert m.peak_active_requests == 4 and m.requests_finished == len(work)
    assert kernels_of(target) == "stock"
    if draft != "none":  # speculation ran and accepted drafts (the output is the target's either way)
        assert m.drafting_rounds > 10 and m.drafts_accepted > 0, (m.drafting_rounds, m.drafts_accepted)


def test_the_stock_kernels_fail_the_logits_check(setup):
    # negative control: chunks and batches on the stock kernels round differently from a one-shot prefill
    target, work, refs = setup
    engine = DSparkEngine(target, None, policy="none", max_batch_size=4, kernels="stock", max_prefill_tokens=BUDGET)
    _, differ, compared = _mismatches(_run(engine, work), refs)
    assert differ > 0, compared


def test_a_chunk_that_does_not_see_the_earlier_chunks_fails_the_token_check(setup, monkeypatch):
    # negative control: each prefill chunk attends only to itself (as if the cache were empty): written and read
    # at positions from 0, the slot's earlier chunks out of sight
    target, work, refs = setup
    forward = engine_module.varlen_target_forward

    def forgetful(target, stack, store, slots, new_tokens, *args, **kwargs):
        prefill = [s for s in slots if store.owners[s].prefilled < len(store.owners[s].prompt)]
        saved = [store.lengths[s] for s in prefill]
        if store.allocated:  # room where the engine will count them (their lengths advance by the chunks)
            store.reserve(max(store.lengths[s] + len(t) for s, t in zip(slots, new_tokens)))
        for s in prefill:
            store.lengths[s] = 0
        try:
            return forward(target, stack, store, slots, new_tokens, *args, **kwargs)
        finally:
            for s, n in zip(prefill, saved):
                store.lengths[s] = n

    monkeypatch.setattr(engine_module, "varlen_target_forward", forgetful)
    engine = DSparkEngine(target, None, policy="none", max_batch_size=4, kernels="exact", max_prefill_tokens=BUDGET)
    wrong, differ, _ = _mismatches(_run(engine, work), refs)
    assert wrong > 0 and differ > 0


def test_any_budget_gives_the_same_output(setup):
    # one chunk per prompt (a budget above every prompt), or a budget that is not a divisor of anything
    target, work, refs = setup
    for budget in (2048, 173):
        engine = DSparkEngine(target, None, policy="none", max_batch_size=3, kernels="exact", max_prefill_tokens=budget)
        wrong, differ, _ = _mismatches(_run(engine, work), refs)
        assert wrong == 0 and differ == 0, budget


def test_pending_features_of_a_chunked_prompt_equal_the_one_shot_prefill(setup):
    target, work, _ = setup
    draft = make_aligned_draft(target, "none", block_size=4)
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=4, kernels="exact", max_prefill_tokens=BUDGET)
    seen = {}

    def grab(engine):  # a request whose prefill just ended has not drafted yet: its pending features are the prompt's
        for req in engine._active:
            if req.prefilled == len(req.prompt) and len(req.tokens) == 1 and req.rid not in seen:
                assert len(req.dkv) == 0
                seen[req.rid] = (req.prompt, torch.cat(req.draft.pending), len(req.draft.pending))

    _run(engine, work, checks=grab)
    assert len(seen) == len(work) and max(chunks for _, _, chunks in seen.values()) >= 18
    with torch.no_grad(), use_kernels(target, mode="exact"):
        for prompt, features, _ in seen.values():
            _, expected = forward_with_features(target, engine.layer_ids, torch.tensor([prompt]))
            assert torch.equal(features, expected[0]), len(prompt)


def test_decoding_requests_keep_getting_rounds_while_a_long_prompt_is_prefilled():
    target = _target()
    engine = DSparkEngine(target, None, policy="none", max_batch_size=4, kernels="exact", max_prefill_tokens=BUDGET)
    short = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # the short request's prefill and first token
    long = engine.add_request([t % VOCAB for t in range(1, 1101)], SamplingParams(max_new_tokens=4, ignore_eos=True))
    emitted_while_prefilling, first_token_round = [], None
    for i in range(30):
        events = engine.step()
        tokens = {ev.request_id: len(ev.token_ids) for ev in events}
        if long in tokens:
            first_token_round = i
            break
        emitted_while_prefilling.append(tokens.get(short, 0))
    assert first_token_round == -(-1100 // BUDGET) - 1  # one chunk per round, the first token with the last one
    assert all(n == 1 for n in emitted_while_prefilling), emitted_while_prefilling  # a token every round
    assert engine.metrics.prefill_chunks == 1 + -(-1100 // BUDGET)
    engine.release_kernels()


def test_max_prefill_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        DSparkEngine(_target(), None, policy="none", max_prefill_tokens=0)


def test_slot_arrange_moves_rows_and_their_tokens():
    store = SlotKV(4)
    for owner in "abc":
        store.add(owner)
    kv = [(torch.arange(3 * 2 * 5 * 2, dtype=torch.float32).view(3, 2, 5, 2),) * 2]
    store.reserve(5, like=[(k[0], v[0]) for k, v in kv])
    for slot in range(3):
        for buf in (store._keys[0], store._values[0]):
            buf[slot] = float(slot)
        store.lengths[slot] = slot + 1
    moved = store.arrange([2, 1, 0])
    assert store.owners == ["c", "b", "a"] and store.lengths == [3, 2, 1]
    assert sorted(moved) == [("a", 2), ("c", 0)]
    # a moved row's committed tokens move with it (positions past its length are scratch, not copied)
    assert store._keys[0][0, :, :3].eq(2.0).all() and store._values[0][2, :, :1].eq(0.0).all()
    assert store._keys[0][1].eq(1.0).all()  # a row that stays is untouched
    with pytest.raises(ValueError, match="permutation"):
        store.arrange([0, 0, 1])


def test_the_server_default_budget_is_the_engines(monkeypatch):
    # `dspark serve` states the default without importing the engine (no torch at argument parsing): they agree
    import argparse

    from dspark_hf.commands.serve import add_arguments
    from dspark_hf.decoding.engine import DEFAULT_MAX_PREFILL_TOKENS

    monkeypatch.delenv("DSPARK_MAX_PREFILL_TOKENS", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS
