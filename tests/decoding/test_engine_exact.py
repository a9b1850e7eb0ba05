"""The batched engine on the exact kernels: every row of every round is computed as plain decoding computes it.

The check is on logits, not only on tokens (greedy tokens would agree by luck almost always): the engine runs
fp32 tiny targets with requests joining mid-generation (so rounds mix rows of different context lengths and,
with a draft, different numbers of verified tokens), and records each request's target logits round by
round. Plain exact decoding of each prompt alone (`generate(dspark_kernels="exact", output_logits=True)`)
gives the logits of every step; each committed row of the engine must be `torch.equal` to its step. The stock
kernels must fail the same check (the batched forward rounds differently from one-row forwards), which shows
the check has the power to tell batch-invariant kernels from others.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.kernels import is_lean, kernels_of

from helpers import make_aligned_draft, make_target, record_committed_logits, run_joining

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512


def _target(arch: str):
    # fp32 (the exact kernels' dtype), wide enough that the stock kernels' multi-row path rounds differently,
    # Markov-like so that an aligned draft is often right and rounds accept several tokens
    return make_target(arch, vocab_size=VOCAB, hidden_size=128, num_layers=2, markov=True, dtype=torch.float32)


def _workload(n: int = 7, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 40, 9, 150, 17, 5, 28][:n]  # 150: a prefill over 64 tokens
    news = [14, 9, 20, 6, 17, 11, 13][:n]
    return [(torch.randint(0, VOCAB, (length,), generator=gen).tolist(), m) for length, m in zip(lengths, news)]


def _engine_logits(engine, work):
    """Run `work` with a request joining before every round; per request, the committed rows' target logits."""
    rows = record_committed_logits(engine)
    ids, outputs = run_joining(engine, work)
    return [(outputs[i].token_ids, rows.get(i, [])) for i in ids]


def _mismatches(target, draft, policy: str, kernels: str) -> tuple[int, int]:
    """(engine rows that differ from plain exact decoding's logits, rows compared); tokens must agree."""
    work = _workload()
    engine = DSparkEngine(target, draft, policy=policy, max_batch_size=8, kernels=kernels)
    results = _engine_logits(engine, work)
    assert kernels_of(target) == "stock"  # the engine gave the models back when it went idle
    differ = compared = 0
    for (prompt, m), (tokens, rows) in zip(work, results):
        ref = target.generate(
            torch.tensor([prompt]), max_new_tokens=m, do_sample=False, dspark_kernels="exact",
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        assert tokens == ref.sequences[0, len(prompt) :].tolist()
        steps = [logits[0] for logits in ref.logits[1:]]  # step 0 is the prefill's (made outside the rounds)
        assert len(rows) >= len(steps)  # (a final round may verify past max_new_tokens: those rows are extra)
        differ += sum(not torch.equal(row, step) for row, step in zip(rows, steps))
        compared += len(steps)
    return differ, compared


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("policy", ["fixed", "none"])
def test_exact_engine_rows_equal_plain_exact_decoding_bit_for_bit(arch, policy):
    target = _target(arch)
    draft = make_aligned_draft(target, block_size=5) if policy != "none" else None
    differ, compared = _mismatches(target, draft, policy, "exact")
    assert compared > 50
    assert differ == 0


def test_stock_engine_fails_the_same_check():
    # negative control: on the stock kernels the batched rounds round differently from one-row decoding
    target = _target("llama")
    differ, compared = _mismatches(target, make_aligned_draft(target, block_size=5), "fixed", "stock")
    assert differ > 0, compared


def test_exact_engine_runs_lean_layers_and_unpadded_rounds_and_refuses_the_packed_layout():
    # the exact engine's forwards pack the rows' tokens with no padding (`varlen_target_forward`), each row's
    # queries over its own slot; the `packed` layout (one sequence over every row's past) stays refused
    target = _target("qwen2")
    draft = make_aligned_draft(target, block_size=5)
    engine = DSparkEngine(target, draft, policy="fixed", kernels="exact")
    assert engine.layout == "padded"
    rid = engine.add_request(list(range(1, 12)), SamplingParams(max_new_tokens=12))
    engine.step()  # admits and prefills: the models are switched for the busy period
    assert kernels_of(target) == "exact" and all(is_lean(layer) for layer in target.model.layers)
    outs = {}
    while engine.has_unfinished():
        outs.update({e.request_id: e for e in engine.step() if e.finished})
    assert outs[rid].output.ok
    assert kernels_of(target) == "stock" and not any(is_lean(layer) for layer in target.model.layers)
    counts = engine.metrics.layout_counts
    assert counts["varlen"] > 1 and counts["padded"] == 0 and counts["packed"] == 0
    with pytest.raises(ValueError, match="layout='packed'"):
        DSparkEngine(target, draft, kernels="exact", layout="packed")
    with pytest.raises(ValueError, match="kernels must be one of"):
        DSparkEngine(target, draft, kernels="fast")


def test_release_kernels_gives_the_models_back_while_requests_are_held():
    target = _target("llama")
    engine = DSparkEngine(target, None, policy="none", kernels="exact")
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=8))
    engine.step()
    assert kernels_of(target) == "exact"
    engine.release_kernels()
    assert kernels_of(target) == "stock"
    while engine.has_unfinished():  # and the next round takes them again
        engine.step()
        if engine.has_unfinished():
            assert kernels_of(target) == "exact"
    assert kernels_of(target) == "stock"
