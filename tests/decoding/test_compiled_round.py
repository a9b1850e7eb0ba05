"""The compiled drafting round (`dspark_hf.decoding.compiled`) drafts exactly what the eager round drafts.

On the exact CPU kernels, `generate()`'s drafting round runs in three compiled calls (ingest, block, greedy
sequential + confidence heads). The draft's proposals never decide the output (verification does), but a
faithful compiled round must propose the same tokens with the same confidences as the eager round: checked here
round by round, bit for bit, on tiny fp32 Llama / Qwen2 / Qwen3 targets, greedy and sampled, with and without a
Markov head, a confidence head and a draft vocabulary subset. A deliberately wrong compiled round (its rotation
one position off) fails the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf import last_generation_stats
from dspark_hf.decoding import compiled as compiled_module
from dspark_hf.decoding.compiled import CompiledRound
from dspark_hf.kernels import exact_kernels_backend, is_exact_norm
from dspark_hf.kernels.exact import exact_kernels

from helpers import make_aligned_draft, make_target, randomize

pytestmark = pytest.mark.skipif(exact_kernels_backend() != "cpp", reason="the compiled round needs the C++ kernels")


def _pair(arch: str, head: str, aligned: bool, subset: bool):
    target = make_target(arch, markov=aligned, dtype=torch.float32, seed=3)
    draft = make_aligned_draft(target, head=head, block_size=5)
    if not aligned:
        randomize(draft, seed=4)
    if subset:  # half the vocabulary, every other id
        draft.set_draft_vocab(list(range(0, target.config.vocab_size, 2)))
    return target, draft


def _rounds(target, draft, compiled: bool, do_sample: bool):
    draft.generation_config.dspark_compiled = compiled  # the draft's default, as any option
    prompt = torch.tensor([[3, 17, 42, 8, 91, 5, 23]])
    torch.manual_seed(7)
    out = target.generate(
        prompt,
        assistant_model=draft,
        max_new_tokens=24,
        do_sample=do_sample,
        dspark_kernels="exact",
        dspark_policy="fixed",
        dspark_lookup=False,
    )
    stats = last_generation_stats(draft)
    rounds = [(r.drafted, r.confidence_logits, r.verified, r.accepted) for r in stats.rounds]
    return out, rounds


@pytest.mark.parametrize(
    "arch,head,aligned,subset",
    [
        ("llama", "markov", True, False),
        ("qwen2", "markov", False, True),
        ("qwen3", "markov", False, False),
        ("llama", "none", False, True),
    ],
)
@pytest.mark.parametrize("do_sample", [False, True])
def test_compiled_round_drafts_exactly_what_the_eager_round_drafts(arch, head, aligned, subset, do_sample, monkeypatch):
    target, draft = _pair(arch, head, aligned, subset)
    calls = {"block": 0, "greedy": 0}
    for name in calls:
        original = getattr(CompiledRound, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(CompiledRound, name, counting)
    out_c, rounds_c = _rounds(target, draft, compiled=True, do_sample=do_sample)
    assert calls["block"] == sum(1 for r in rounds_c if r[0]) > 0  # the compiled round really ran
    assert calls["greedy"] == (0 if do_sample else calls["block"])  # sampling keeps the eager sequential head
    out_e, rounds_e = _rounds(target, draft, compiled=False, do_sample=do_sample)
    assert calls["block"] == sum(1 for r in rounds_c if r[0])  # and the eager run did not
    assert rounds_c == rounds_e  # drafted tokens, confidence logits, lengths, acceptance: bit for bit
    assert torch.equal(out_c, out_e)
    if not do_sample:  # and the output is plain exact decoding's, as always
        plain = target.generate(
            torch.tensor([[3, 17, 42, 8, 91, 5, 23]]), max_new_tokens=24, do_sample=False, dspark_kernels="exact"
        )
        assert torch.equal(out_c, plain)
    if aligned:
        assert sum(r[3] for r in rounds_c) > len(rounds_c)  # drafts were accepted: ingest of several tokens ran


def test_a_compiled_round_rotated_one_position_off_fails_the_comparison(monkeypatch):
    target, draft = _pair("qwen3", "markov", False, False)
    _, rounds_e = _rounds(target, draft, compiled=False, do_sample=False)
    original = CompiledRound.__init__

    def shifted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.cos, self.sin = self.cos[1:].contiguous(), self.sin[1:].contiguous()  # position p rotated as p + 1

    monkeypatch.setattr(CompiledRound, "__init__", shifted)
    _, rounds_c = _rounds(target, draft, compiled=True, do_sample=False)
    assert [r[1] for r in rounds_c] != [r[1] for r in rounds_e]


def test_the_compiled_round_applies_only_where_it_computes_what_the_eager_round_does():
    target, draft = _pair("llama", "markov", False, False)
    assert CompiledRound.create(draft, 64) is None  # stock kernels: the draft's layers are not lean
    with exact_kernels(target, draft):
        assert isinstance(CompiledRound.create(draft, 64), CompiledRound)
        assert is_exact_norm(draft.norm) and is_exact_norm(draft.hidden_norm)
    assert not is_exact_norm(draft.norm)  # the exact mode gives the norms back
    gated_target, gated = _pair("llama", "gated", False, False)
    with exact_kernels(gated_target, gated):
        assert CompiledRound.create(gated, 64) is None  # only the plain Markov head has a compiled step
    fp64 = make_target("llama", dtype=torch.float64)
    draft64 = make_aligned_draft(fp64)
    with exact_kernels(fp64, draft64):
        assert not compiled_module.eligible(draft64)  # the compiled round is float32 only
