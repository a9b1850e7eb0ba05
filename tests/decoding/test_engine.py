"""The batched engine: per-request greedy exactness under continuous batching, isolation of bad requests,
bounded memory, streaming, metrics.

Every exactness check compares a request's engine output with plain greedy `generate()` on that prompt
alone. Batches mix short (2 tokens) and long (70 tokens) prompts and different `max_new_tokens` (1 to 30),
requests join while others run (added between rounds) and finish at different rounds; both forward layouts
(padded and packed) and every policy are covered, on three architectures. Targets are fp64 (see
`helpers.py`), so padding or packing cannot flip an argmax through rounding. Drafts are aligned (mostly
right), so multi-token acceptance, per-request KV rollback and draft-context bookkeeping are exercised.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dspark_hf import DSparkEngine, SamplingParams, last_generation_stats
from dspark_hf.decoding.metrics import EngineMetrics
from dspark_hf.decoding.target_forward import choose_layout, context_limit
from dspark_hf.scheduling.policies import HardwareAwarePolicy, LaggedHardwareAwarePolicy, UniformHardwareAwarePolicy
from dspark_hf.scheduling.sps import SPSProfile

from helpers import make_aligned_draft, make_target

VOCAB = 96
JAGGED = SPSProfile({1: 0.065, 2: 0.107, 16: 0.107, 32: 0.142, 64: 0.307, 128: 0.62})
POLICIES = {
    "fixed": "fixed",
    "threshold": "threshold:0.3",
    "hardware_aware": HardwareAwarePolicy(sps=JAGGED),
    "hardware_aware_lagged": LaggedHardwareAwarePolicy(sps=JAGGED),
    "hardware_aware_uniform": UniformHardwareAwarePolicy(sps=JAGGED),
    "none": "none",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _workload(seed: int = 11, n: int = 12):
    """Prompts from 2 to 70 tokens and max_new_tokens from 1 to 30 (a 1 finishes right after the prefill)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [2, 70, 5, 33, 3, 48, 9, 17, 61, 4, 25, 12][:n]
    news = [12, 7, 30, 1, 21, 16, 9, 26, 3, 18, 11, 24][:n]
    return [(torch.randint(0, VOCAB, (length,), generator=gen).tolist(), m) for length, m in zip(lengths, news)]


@pytest.fixture(scope="module")
def setups():
    """Per architecture: target, aligned draft, workload and plain greedy references."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        target = make_target(arch, vocab_size=VOCAB, markov=True)
        draft = make_aligned_draft(target, "markov", block_size=5)
        work = _workload()
        refs = [
            target.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False)[0, len(p) :].tolist() for p, m in work
        ]
        out[arch] = (target, draft, work, refs)
    return out


def _run_with_joins(engine, work, first: int = 4):
    """Add `first` requests, then one more before every round; returns outputs, streamed tokens, finish rounds."""
    ids, streamed, finished_at, outputs = [], {}, {}, {}
    pending = list(work)
    for prompt, m in pending[:first]:
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=m)))
    pending = pending[first:]
    rounds = 0
    while engine.has_unfinished() or pending:
        if pending:  # a request joins while the others are mid-generation
            prompt, m = pending.pop(0)
            ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=m)))
        for ev in engine.step():
            streamed.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                finished_at[ev.request_id] = rounds
                outputs[ev.request_id] = ev.output
        rounds += 1
        assert rounds < 500
    return [outputs[i] for i in ids], [streamed[i] for i in ids], [finished_at[i] for i in ids]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_identity_with_continuous_batching(setups, arch, policy, layout):
    target, draft, work, refs = setups[arch]
    engine = DSparkEngine(target, draft, policy=POLICIES[policy], max_batch_size=5, layout=layout)
    outputs, streamed, finished_at = _run_with_joins(engine, work)
    for (prompt, m), out, ref, stream in zip(work, outputs, refs, streamed):
        assert out.ok, out.error
        assert out.token_ids == ref, f"{arch}/{policy}/{layout}: prompt of {len(prompt)} tokens, max_new_tokens={m}"
        assert stream == out.token_ids, "streamed tokens must add up to the final output"
        assert out.finish_reason == "length"
    assert len(set(finished_at)) >= 6, f"requests should finish at many different rounds: {finished_at}"
    m = engine.metrics
    assert m.peak_active_requests == 5 and m.peak_queue_length > 0
    assert m.requests_finished == len(work) and m.tokens_generated == sum(len(r) for r in refs)
    if policy == "fixed":
        assert m.tau >= 2.0, f"aligned drafts should be mostly right, τ={m.tau:.2f}"
        assert max(m.length_counts) and m.mean_verification_length > 3
    if policy == "none":
        assert m.tau == 1.0 and m.drafts_verified == 0
    if policy == "threshold":
        assert sum(c > 0 for c in m.length_counts) > 2, "the threshold policy should vary lengths"


def test_uniform_policy_skips_drafting_under_load_and_stays_exact(setups, monkeypatch):
    """Forwards up to 8 tokens are free, beyond that dear: 1-4 active requests draft, 5 or more skip drafting
    (`plain_samples=0`: no measuring rounds, the batch size alone decides).

    Requests join and finish, so the batch crosses that line both ways; outputs stay exactly greedy, the draft
    runs only in rounds that verify, and its context stays in step through the rounds that skip it.
    """
    import dspark_hf.decoding.backends.eager as engine_module  # the engine drafts through the eager backend

    target, draft, work, refs = setups["qwen2"]
    calls, at_draft = [], []
    real_draft_block = engine_module.draft_block

    def draft_block(d, stores, anchors, positions=None):  # when the draft drafts, its context is the target's
        rows = len(anchors)
        at_draft.append((stores.lengths[:rows], engine._kv.lengths[:rows]))
        assert at_draft[-1][0] == at_draft[-1][1], at_draft[-1]
        calls.append(rows)
        return real_draft_block(d, stores, anchors, positions)

    monkeypatch.setattr(engine_module, "draft_block", draft_block)
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 1.0, 8: 1.0, 9: 50.0, 512: 60.0}), plain_samples=0)
    engine = DSparkEngine(target, draft, policy=policy, max_batch_size=6)
    real_step, in_step = engine.step, []

    def step():  # after every round, the draft's context plus the features it has not ingested yet (rounds
        # that skip drafting never run the draft) cover exactly what the target has committed
        events = real_step()
        in_step.append([(len(r.dkv) + r.pending_tokens, len(r.kv)) for r in engine._active])
        assert all(d == t for d, t in in_step[-1]), in_step[-1]
        return events

    engine.step = step
    outputs, _, _ = _run_with_joins(engine, work, first=2)
    assert [o.token_ids for o in outputs] == refs
    assert calls and max(calls) <= 4, f"drafting ran for batches of {sorted(set(calls))} requests"
    rounds = [r for o in outputs for r in o.stats.rounds]
    skipped = [r for r in rounds if not r.drafted]
    assert len(skipped) > 10 and len(rounds) - len(skipped) > 10, (len(skipped), len(rounds))
    m = engine.metrics
    assert m.drafts_accepted > 0 and sum(c > 0 for c in m.length_counts[1:]) >= 2, m.length_counts


@pytest.mark.parametrize("head", ["gated", "rnn", "none"])
def test_greedy_identity_other_sequential_heads(setups, head):
    target, _, work, refs = setups["qwen3"]
    draft = make_aligned_draft(target, head, block_size=4)
    outputs, _, _ = _run_with_joins(DSparkEngine(target, draft, policy="threshold:0.3", max_batch_size=4), work)
    assert [o.token_ids for o in outputs] == refs


@pytest.mark.parametrize("policy", ["fixed", "hardware_aware"])
def test_auto_layout_switches_per_forward_and_stays_exact(setups, policy):
    target, draft, work, refs = setups["llama"]
    engine = DSparkEngine(target, draft, policy=POLICIES[policy], max_batch_size=5, layout="auto")
    outputs, _, _ = _run_with_joins(engine, work)
    assert [o.token_ids for o in outputs] == refs
    counts = engine.metrics.layout_counts
    assert counts["padded"] > 0 and counts["packed"] > 0, counts


SMOLLM_LINEAR_COST = 3073.0  # linear_cost_in_keys(SmolLM2-135M-Instruct)


@pytest.mark.parametrize(
    "context, counts, expected",
    [
        # measured with SmolLM2-135M on 2 CPU threads (docs/engine.md); padded/packed time ratio in the comment
        (64, [1, 4, 7, 2], "packed"),  # R=4 ragged, 1.20
        (256, [1, 4, 7, 2], "packed"),  # R=4 ragged, 1.21
        (64, [1, 4, 7, 2, 5, 8, 3, 6] * 2, "packed"),  # R=16 ragged, 1.23
        (256, [1, 4, 7, 2, 5, 8, 3, 6] * 2, "padded"),  # R=16 ragged, 0.88
        (64, [8] * 32, "padded"),  # R=32 uniform, 0.67
        (256, [8] * 16, "padded"),  # R=16 uniform, 0.62
        (256, [1] * 32, "padded"),  # R=32 one token per row (plain decoding), 0.57
    ],
)
def test_layout_cost_model_table(context, counts, expected):
    assert choose_layout([context] * len(counts), counts, SMOLLM_LINEAR_COST) == expected


def test_per_request_rounds_match_single_request_generate(setups):
    """The engine's rounds for each request are those of `generate(assistant_model=draft)` (fixed policy)."""
    target, draft, work, _ = setups["llama"]
    outputs = DSparkEngine(target, draft, policy="fixed", max_batch_size=12).generate(
        [p for p, _ in work], [SamplingParams(max_new_tokens=m) for _, m in work]
    )
    for (prompt, m), out in zip(work, outputs):
        target.generate(torch.tensor([prompt]), max_new_tokens=m, do_sample=False, assistant_model=draft)
        single = [(r.verified, r.accepted) for r in last_generation_stats(draft).rounds]
        assert [(r.verified, r.accepted) for r in out.stats.rounds] == single
        assert sum(r.accepted + 1 for r in out.stats.rounds) + 1 == len(out.token_ids)
        summary = out.summary()
        assert summary["tau"] == last_generation_stats(draft).tau and summary["tokens_per_second"] > 0


def test_eos_and_repetition_penalty_match_generate(setups):
    """Per-request stop tokens and logits processors behave as in plain generate()."""
    target, draft, work, _ = setups["qwen2"]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=4)
    prompts, params, refs = [], [], []
    for i, (prompt, _) in enumerate(work[:8]):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False)[0, len(prompt) :].tolist()
        eos = next((t for j, t in enumerate(ref) if j >= 3 and t not in ref[:j]), ref[-1])
        penalty = 1.3 if i % 2 else None
        plain = target.generate(
            torch.tensor([prompt]), max_new_tokens=25, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            repetition_penalty=penalty,
        )  # fmt: skip
        refs.append(plain[0, len(prompt) :].tolist())
        prompts.append(prompt)
        params.append(SamplingParams(max_new_tokens=25, eos_token_id=eos, repetition_penalty=penalty))
    outputs = engine.generate(prompts, params)
    for out, ref in zip(outputs, refs):
        assert out.token_ids == ref
    assert sum(o.finish_reason == "eos" for o in outputs) >= 4


def test_bad_requests_get_errors_and_do_not_disturb_others(setups):
    target, draft, work, refs = setups["llama"]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=3, max_tokens=200)
    limit = target.config.max_position_embeddings
    bad = {
        "empty": ([], SamplingParams()),
        "too long": ([1] * (limit + 5), SamplingParams()),
        "out of vocabulary": ([1, VOCAB + 3], SamplingParams()),
        "max_new_tokens": ([1, 2], SamplingParams(max_new_tokens=0)),
        "over budget": ([1, 2, 3], SamplingParams(max_new_tokens=250)),
        "text without tokenizer": ("hello", SamplingParams()),
        "bad top_p": ([1, 2], SamplingParams(do_sample=True, top_p=1.5)),
    }
    good = list(zip(work[:6], refs[:6]))
    prompts, params = [], []
    for i, ((prompt, m), _) in enumerate(good):  # interleave good and bad requests
        prompts.append(prompt)
        params.append(SamplingParams(max_new_tokens=m))
        if i < len(bad):
            p, sp = list(bad.values())[i]
            prompts.append(p)
            params.append(sp)
    prompts.append(list(bad.values())[-1][0])
    params.append(list(bad.values())[-1][1])
    outputs = engine.generate(prompts, params)
    good_out = [o for o in outputs if o.ok]
    bad_out = [o for o in outputs if not o.ok]
    assert [o.token_ids for o in good_out] == [r for _, r in good]
    assert len(bad_out) == len(bad) and all(o.finish_reason == "error" and not o.token_ids for o in bad_out)
    messages = [o.error for o in bad_out]
    for needle in ["empty", f"context holds {limit}", "outside the target's vocabulary", "max_new_tokens must be",
                   "max_tokens is 200", "need a tokenizer", "top_p"]:  # fmt: skip
        assert any(needle in msg for msg in messages), (needle, messages)
    assert engine.metrics.requests_failed == len(bad)


def test_memory_stays_bounded_with_ten_times_more_requests(setups):
    target, draft, _, _ = setups["qwen3"]
    max_batch, budget = 3, 180
    work = _workload(seed=5) + _workload(seed=6) + _workload(seed=7)[:6]  # 30 requests: 10x max_batch_size
    work = [(p[:40], m) for p, m in work]
    engine = DSparkEngine(target, draft, policy="threshold:0.3", max_batch_size=max_batch, max_tokens=budget)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=m)) for p, m in work]
    seen_active, outputs = [], {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                outputs[ev.request_id] = ev.output
        seen_active.append(len(engine._active))
        assert engine._reserved <= budget
    m = engine.metrics
    cfg = target.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 8  # fp64
    dcfg = draft.config
    kv_per_token += 2 * dcfg.num_hidden_layers * dcfg.num_key_value_heads * dcfg.head_dim * 8
    assert max(seen_active) == m.peak_active_requests <= max_batch
    assert m.peak_kv_tokens <= budget and m.peak_kv_bytes <= budget * kv_per_token
    assert m.peak_queue_length >= len(work) - max_batch - 1
    assert m.active_requests == 0 and m.kv_bytes == 0 and not engine._active and not engine._queue
    for rid, (prompt, mx) in zip(ids, work):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=mx, do_sample=False)[0, len(prompt) :]
        assert outputs[rid].token_ids == ref.tolist()


def test_stream_yields_tokens_as_they_are_accepted(setups):
    target, draft, work, refs = setups["llama"]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=4)
    chunks, finals = {}, {}
    for ev in engine.stream([p for p, _ in work[:6]], [SamplingParams(max_new_tokens=m) for _, m in work[:6]]):
        chunks.setdefault(ev.request_id, []).append(ev.token_ids)
        if ev.finished:
            finals[ev.request_id] = ev.output
    assert len(finals) == 6
    for rid, ref in zip(sorted(finals), refs[:6]):
        assert [t for c in chunks[rid] for t in c] == ref == finals[rid].token_ids
    assert any(len(c) > 1 for cs in chunks.values() for c in cs[1:]), "accepted drafts arrive several at once"


def _tiny_tokenizer():
    words = {f"w{i}": i for i in range(1, 90)}
    words.update({"<unk>": 0, "<eos>": 90, "user:": 91, "assistant:": 92})
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tok


def test_text_and_chat_prompts_with_a_tokenizer(setups):
    target, draft, _, _ = setups["llama"]
    tok = _tiny_tokenizer()
    engine = DSparkEngine(target, draft, tok, policy="fixed", max_batch_size=2)
    chat = [{"role": "user", "content": "w5 w6 w7"}]
    outs = engine.generate(["w1 w2 w3", chat, torch.tensor([[1, 2, 3]])], SamplingParams(max_new_tokens=10))
    assert outs[0].prompt_token_ids == [1, 2, 3] == outs[2].prompt_token_ids
    assert outs[1].prompt_token_ids == [91, 5, 6, 7, 92]
    assert outs[0].token_ids == outs[2].token_ids
    assert outs[0].text == tok.decode(outs[0].token_ids, skip_special_tokens=True)
    texts = [ev.text for ev in engine.stream(["w1 w2 w3"], SamplingParams(max_new_tokens=10))]
    assert "".join(texts) == outs[0].text


def test_sampling_params_run_and_are_reproducible(setups):
    target, draft, work, _ = setups["llama"]
    params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=8, top_p=0.9, seed=3)
    runs = [
        DSparkEngine(target, draft, policy="fixed", max_batch_size=size).generate([p for p, _ in work[:5]], params)
        for size in (5, 2)
    ]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]], "seeded requests are reproducible"
    assert all(len(o.token_ids) == 12 for o in runs[0])


def test_metrics_dict_and_prometheus_text(setups, monkeypatch):
    parser = pytest.importorskip("prometheus_client.parser")  # the `serve` extra
    text_string_to_metric_families = parser.text_string_to_metric_families
    target, draft, work, _ = setups["llama"]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=4)
    engine.generate([p for p, _ in work[:6]], [SamplingParams(max_new_tokens=m) for _, m in work[:6]])
    d = engine.metrics.to_dict()
    for key in ["tau", "mean_verification_length", "acceptance_by_position", "tokens_per_second", "queue_length",
                "peak_queue_length", "mean_queue_length", "requests_finished", "length_counts"]:  # fmt: skip
        assert key in d
    assert d["requests_finished"] == 6 and d["tau"] > 1 and len(d["acceptance_by_position"]) == 5
    text = engine.metrics.to_prometheus()
    parsed = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    assert parsed["dspark_engine_requests_finished_total"] == 6
    assert parsed["dspark_engine_tau"] == pytest.approx(d["tau"])
    by_pos = [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.endswith("by_position")]
    assert [s.labels["position"] for s in by_pos] == ["1", "2", "3", "4", "5"]
    # without prometheus_client the built-in formatter gives the same samples
    import builtins

    real_import = builtins.__import__

    def no_client(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_client)
    fallback = engine.metrics.to_prometheus()
    monkeypatch.setattr(builtins, "__import__", real_import)

    def samples(t):
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), str(s.value))
            for f in text_string_to_metric_families(t)
            for s in f.samples
        )

    assert samples(fallback) == samples(text)


def test_metrics_reset_andcontext_limit():
    m = EngineMetrics(block_size=3)
    m.record_request_round(2, 1)
    m.record_gauges(2, 5, 40, 1000)
    m.reset()
    assert m.request_rounds == 0 and m.queue_length == 5 and m.peak_queue_length == 0
    from transformers import MistralConfig, Qwen2Config

    assert context_limit(Qwen2Config(max_position_embeddings=512)) == 512
    assert context_limit(MistralConfig(max_position_embeddings=4096, sliding_window=128)) == 128


def test_cancel_frees_the_slot_and_leaves_the_others_exact(setups):
    """A cancelled active request frees its batch slot and KV reservation at once (the queued request is admitted
    next round), emits nothing more, and the surviving requests still equal plain `generate()`; cancelling a
    queued request or an unknown id behaves as documented."""
    target, draft, work, refs = setups["llama"]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=2)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=m)) for p, m in work[:4]]
    engine.step()  # admits 0 and 1 (prefill); 2 and 3 wait
    assert engine.queue_length == 2
    assert engine.cancel(ids[3]) is True  # queued
    assert engine.cancel(ids[1]) is True  # active: its slot goes to request 2 at the next round
    assert engine.cancel(ids[1]) is False and engine.cancel(12345) is False
    assert engine._reserved == len(work[0][0]) + work[0][1]
    outputs, seen = {}, set()
    while engine.has_unfinished():
        for event in engine.step():
            seen.add(event.request_id)
            if event.finished:
                outputs[event.request_id] = event.output
    assert seen == {ids[0], ids[2]}
    assert outputs[ids[0]].token_ids == refs[0] and outputs[ids[2]].token_ids == refs[2]
    assert engine._reserved == 0 and engine.metrics.peak_active_requests == 2


def test_a_length_fixed_before_drafting_drafts_only_those_positions(setups):
    """`fixed:2` knows its length before drafting: the sequential head runs 2 positions, not the block's 5, and
    the output is still the target's own."""
    target, draft, work, refs = setups["qwen2"]
    engine = DSparkEngine(target, draft, policy="fixed:2", max_batch_size=5)
    outputs, _, _ = _run_with_joins(engine, work)
    assert [o.token_ids for o in outputs] == refs
    drafted = [len(r.drafted) for o in outputs for r in o.stats.rounds if r.drafted]
    assert drafted and set(drafted) == {2}, drafted
    assert engine.metrics.tau > 2.0  # an aligned draft: both drafted tokens mostly accepted
