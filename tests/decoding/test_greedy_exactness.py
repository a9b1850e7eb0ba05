"""Greedy speculative output is token-for-token identical to plain greedy `generate()`.

Every architecture (Llama, Qwen2, Qwen3) × sequential head (markov, gated, rnn, none) × policy (fixed,
threshold) runs 20 prompts of different lengths with `max_new_tokens` that cut the last block. Drafts for
the markov-family heads are *aligned* (see `helpers.py`): they are mostly right, so the accept path, the
draft's context bookkeeping and the target's cache rollback are really exercised (τ is asserted ≥ 2.5).
Targets are fp64 so a multi-token verification forward and a one-token forward agree to ~1e-15 and a
near-tie can never flip an argmax.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from dspark_hf import last_generation_stats

from helpers import ARCHS, assert_context_is_the_targets, make_aligned_draft, make_target, record_draft_context

HEADS = ["markov", "gated", "rnn", "none"]
POLICIES = ["fixed", "threshold:0.3", "adaptive:3"]
NUM_PROMPTS = 20
VOCAB = 96


def _prompts(seed: int = 123):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(NUM_PROMPTS):
        length = 2 + (i * 7) % 23
        out.append((torch.randint(0, VOCAB, (1, length), generator=gen), 9 + (i * 5) % 17))
    return out


@pytest.fixture(scope="module")
def references():
    """Per architecture: the target, the prompts and plain greedy outputs."""
    refs = {}
    for arch in ARCHS:
        target = make_target(arch, vocab_size=VOCAB, markov=True)
        outs = [target.generate(ids, max_new_tokens=n, do_sample=False) for ids, n in _prompts()]
        refs[arch] = (target, _prompts(), outs)
    return refs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_identity(references, arch, head, policy):
    target, prompts, expected = references[arch]
    draft = make_aligned_draft(target, head)
    taus, verified = [], []
    for (ids, max_new), ref in zip(prompts, expected):
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, dspark_policy=policy)
        out = target.generate(ids, generation_config=config, assistant_model=draft)
        assert torch.equal(out, ref), f"{arch}/{head}/{policy}: speculative output differs for prompt {ids.tolist()}"
        stats = last_generation_stats(draft)
        # every emitted token is accounted for: one per round plus accepted drafts, plus the prefill token
        assert sum(r.accepted + 1 for r in stats.rounds) + 1 == out.shape[1] - ids.shape[1]
        taus.append(stats.tau)
        verified += [r.verified for r in stats.rounds]
    mean_tau = sum(taus) / len(taus)
    if head != "none" and policy == "fixed":
        assert mean_tau >= 2.5, f"aligned draft should be mostly right, got τ={mean_tau:.2f}"
    if policy.startswith("threshold") and head != "none":
        assert len(set(verified)) > 2, "threshold policy should vary the verified length"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_eos_inside_drafted_block(references, arch):
    """EOS produced inside an accepted block stops generation exactly where plain generate() stops."""
    target, prompts, expected = references[arch]
    draft = make_aligned_draft(target, "markov")
    eos_inside = 0
    for (ids, _), ref in zip(prompts, expected):
        continuation = ref[0, ids.shape[1] :].tolist()
        # an EOS that first appears at step >= 3 of the plain continuation
        eos = next((t for i, t in enumerate(continuation) if i >= 3 and t not in continuation[:i]), None)
        if eos is None:
            continue
        plain = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        spec = target.generate(
            ids, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos, assistant_model=draft
        )
        assert torch.equal(plain, spec)
        assert spec[0, -1].item() == eos
        last = last_generation_stats(draft).rounds[-1]
        eos_inside += eos in last.drafted[: last.verified]
    assert eos_inside >= 3, "the test should hit EOS inside verified drafted blocks several times"


def test_return_dict_scores_and_streamer(references):
    target, prompts, _ = references["llama"]
    draft = make_aligned_draft(target, "markov")
    ids, _ = prompts[3]

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    plain = target.generate(ids, max_new_tokens=21, do_sample=False, return_dict_in_generate=True, output_scores=True)
    spec = target.generate(
        ids,
        max_new_tokens=21,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        assistant_model=draft,
        streamer=streamer,
    )
    assert torch.equal(plain.sequences, spec.sequences)
    assert len(spec.scores) == len(plain.scores) == 21
    for a, b in zip(plain.scores, spec.scores):
        assert torch.allclose(a, b, atol=1e-9)
    streamed = [t for chunk in streamer.chunks for t in chunk]
    assert streamed == spec.sequences[0].tolist() and streamer.ended
    assert any(len(c) > 1 for c in streamer.chunks[1:]), "accepted blocks should stream several tokens at once"


def test_draft_context_matches_target_hidden_states(references):
    """The draft's KV context is exactly the target's features of every committed token, in order."""
    target, prompts, _ = references["qwen3"]
    draft = make_aligned_draft(target, "markov")
    seen = record_draft_context(draft)
    ids, _ = prompts[5]
    out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert len(last_generation_stats(draft).rounds)
    assert_context_is_the_targets(target, draft, seen, out)
