"""Prompt lookup as a second proposer in speculative `generate()` (`dspark_hf.decoding.lookup`).

The search itself (longest suffix first, most recent occurrence, caps), then the two promises with lookup on:
greedy output identical to plain decoding on every architecture with the draft's context kept exact, and
sampling exactly the target's distribution (the chi-square procedure of `test_sampling_exactness.py`), which
fails for a deliberately wrong rule: a copied token reported to the verifier with a `q` it was not drawn from.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import GenerationConfig

from dspark_hf import last_generation_stats
from dspark_hf.decoding import speculator
from dspark_hf.decoding.generation import DSparkCandidateGenerator
from dspark_hf.decoding.lookup import LookupConfig, LookupIndex, lookup_continuation, resolve_lookup

from helpers import ARCHS, assert_context_is_the_targets, make_aligned_draft, make_target, record_draft_context

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_longest_recurring_suffix_wins_and_its_latest_occurrence_is_copied():
    config = LookupConfig(max_tokens=3, max_ngram=3, min_ngram=2)
    # suffix [2, 3] recurs at 1 and 6; the 3-gram [9, 2, 3] only at 5: the longer match decides
    ids = torch.tensor([1, 2, 3, 4, 5, 9, 2, 3, 8, 7, 9, 2, 3])
    assert lookup_continuation(ids, config) == [8, 7, 9]
    # two occurrences of the 2-gram [2, 3]: the most recent one's continuation
    ids = torch.tensor([2, 3, 4, 4, 2, 3, 6, 1, 2, 3])
    assert lookup_continuation(ids, config) == [6, 1, 2]
    assert lookup_continuation(ids, config, limit=1) == [6]  # the round's budget caps it
    assert lookup_continuation(ids, config, limit=0) == []
    # a lone repeated token is not a match with min_ngram 2, but is with 1
    ids = torch.tensor([5, 6, 7, 8, 6])
    assert lookup_continuation(ids, config) == []
    assert lookup_continuation(ids, LookupConfig(min_ngram=1)) == [7, 8, 6]
    # the continuation may run into the suffix itself (a run of one token), never past the sequence
    assert lookup_continuation(torch.tensor([5, 5, 5, 5]), config) == [5]
    assert lookup_continuation(torch.tensor([1, 2]), config) == []


def test_the_incremental_index_answers_as_the_search_does():
    """`LookupIndex` (the engine's, updated with each round's new tokens) gives `lookup_continuation`'s answer on
    every prefix of random sequences over small vocabularies (many matches), for random settings and caps."""
    rng = random.Random(0)
    for _ in range(200):
        longest = rng.randint(1, 4)
        config = LookupConfig(max_tokens=rng.randint(1, 7), max_ngram=longest, min_ngram=rng.randint(1, longest))
        seq = [rng.randrange(rng.randint(2, 6)) for _ in range(60)]
        start = rng.randint(1, 10)
        index, end = LookupIndex(seq[:start], config), start
        while end <= len(seq):
            limit = rng.choice([None, 0, 1, 3, 9])
            expected = lookup_continuation(torch.tensor(seq[:end]), config, limit)
            assert index.continuation(seq[start:end], limit) == expected, (config, seq[:end], limit)
            end += rng.randint(1, 4)


def test_lookup_settings():
    assert resolve_lookup(None) is None and resolve_lookup(False) is None and resolve_lookup("off") is None
    assert resolve_lookup(True) == LookupConfig() == resolve_lookup("on")
    assert resolve_lookup(4) == LookupConfig(max_tokens=4) and resolve_lookup(0) is None
    for bad in ("sometimes", 1.5):
        with pytest.raises(ValueError, match="dspark_lookup"):
            resolve_lookup(bad)
    with pytest.raises(ValueError, match="min_ngram"):
        LookupConfig(min_ngram=3, max_ngram=2)
    from dspark_hf import DSparkConfig

    with pytest.raises(ValueError, match="default_lookup"):
        DSparkConfig(target_num_hidden_layers=4, default_lookup="yes")


def _repetitive_prompts(vocab: int, seed: int = 7):
    """Prompts that repeat a segment, so the continuation is often in the context."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(8):
        segment = torch.randint(0, vocab, (3 + i % 4,), generator=gen)
        noise = torch.randint(0, vocab, (1 + i % 3,), generator=gen)
        prompts.append((torch.cat([segment, noise, segment, noise, segment])[None], 10 + 3 * i))
    return prompts


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_with_lookup_is_identical_and_the_drafts_context_stays_exact(arch):
    """With lookup on, greedy speculative output equals plain greedy output for prompts whose continuation the
    context holds (lookup rounds happen: asserted), every emitted token is accounted for, and the draft's KV
    context still holds exactly the target's features of the committed tokens, in order (lookup rounds do not
    run the draft; their tokens' features are ingested at its next drafting round)."""
    target = make_target(arch, vocab_size=96, markov=True)
    draft = make_aligned_draft(target, "markov")
    lookups = 0
    for ids, max_new in _repetitive_prompts(96):
        ref = target.generate(ids, max_new_tokens=max_new, do_sample=False)
        for lookup in (True, 3):
            config = GenerationConfig(do_sample=False, max_new_tokens=max_new, dspark_lookup=lookup)
            out = target.generate(ids, generation_config=config, assistant_model=draft)
            assert torch.equal(out, ref), f"{arch}: speculative output with lookup differs for {ids.tolist()}"
            rounds = last_generation_stats(draft).rounds
            assert sum(r.accepted + 1 for r in rounds) + 1 == out.shape[1] - ids.shape[1]
            assert all(r.verified <= (3 if lookup == 3 else 7) for r in rounds if r.source == "lookup")
            lookups += sum(r.source == "lookup" for r in rounds)
    assert lookups >= 8, lookups

    seen = record_draft_context(draft)
    ids, _ = _repetitive_prompts(96)[5]
    out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft, dspark_lookup=True)
    assert last_generation_stats(draft).lookup_rounds > 0
    assert_context_is_the_targets(target, draft, seen, out)


def test_lookup_precedence_and_the_policy_never_sees_a_copy():
    """`generate(dspark_lookup=...)` overrides the call's generation config, which overrides the draft's recorded
    `dspark_lookup` (its generation_config.json), which overrides the library default (off); lookup
    rounds are recorded as such and kept out of the draft's acceptance curve and the policy's payoff sums."""
    target = make_target("llama", vocab_size=96, markov=True)
    draft = make_aligned_draft(target, "markov")
    start, _ = _repetitive_prompts(96)[3]
    # the target's next token depends on the last one only, so after a copy of the start of its own output its
    # continuation is already in the context: lookup matches from the first round
    seen = target.generate(start, max_new_tokens=12, do_sample=False)
    ids, max_new = torch.cat([seen, seen[:, : start.shape[1] + 3]], dim=1), 8
    target.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=draft)
    assert last_generation_stats(draft).lookup_rounds == 0  # the library default
    draft.generation_config.dspark_lookup = True  # what a shipped draft records
    target.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=draft)
    assert last_generation_stats(draft).lookup_rounds > 0
    off = GenerationConfig(max_new_tokens=max_new, do_sample=False, dspark_lookup=False)
    target.generate(ids, generation_config=off, assistant_model=draft)  # the call's config overrides the draft's
    assert last_generation_stats(draft).lookup_rounds == 0
    target.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=draft, dspark_policy="adaptive:3")
    stats = last_generation_stats(draft)
    assert stats.lookup_rounds > 0
    assert stats.summary()["lookup_rounds"] == stats.lookup_rounds
    target.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=draft, dspark_lookup=False)
    assert last_generation_stats(draft).lookup_rounds == 0
    with pytest.raises(ValueError, match="only applies"):
        target.generate(ids, max_new_tokens=4, dspark_lookup=True)


# ---------------------------------------------------------------------------------------------- sampling
VOCAB = 4
PROMPT = torch.tensor([[1, 2, 3, 1, 2]])  # the suffix [1, 2] recurs: the first drafting round can copy [3, 1, 2]
WINDOW = 3
N = 3000
ALPHA = 1e-3
SEED = 1  # seeds 1-4 gave p = 0.83, 0.15, 0.12, 0.20; the first seed tried, 20261203, gave p = 0.003 (> alpha)
# min_ngram 1: most rounds find a match in this 4-token vocabulary, so most verified tokens are copies
LOOKUP = LookupConfig(max_tokens=3, max_ngram=2, min_ngram=1)


@pytest.fixture(scope="module")
def sampling_setup():
    target = make_target("llama", vocab_size=VOCAB, num_layers=2, markov=True, logit_scale=0.2)
    cells = torch.tensor(list(itertools.product(range(VOCAB), repeat=WINDOW)))
    full = torch.cat([PROMPT.expand(len(cells), -1), cells], dim=1)
    start = PROMPT.shape[1] - 1
    with torch.no_grad():
        logprobs = torch.log_softmax(target(full).logits.double(), dim=-1)[:, start : start + WINDOW]
    joint = logprobs.gather(-1, cells[..., None])[..., 0].sum(-1).exp().numpy()
    return target, joint


def _sample_counts(target, draft) -> tuple[np.ndarray, dict]:
    config = GenerationConfig(do_sample=True, max_new_tokens=WINDOW + 1, dspark_lookup=LOOKUP)
    index = {cell: i for i, cell in enumerate(itertools.product(range(VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    info = {"lookup_verified": 0, "lookup_accepted": 0, "draft_verified": 0}
    torch.manual_seed(SEED)
    for _ in range(N):
        out = target.generate(PROMPT, generation_config=config, assistant_model=draft)
        counts[index[tuple(out[0, PROMPT.shape[1] :].tolist()[:WINDOW])]] += 1
        for r in last_generation_stats(draft).rounds:
            if r.source == "lookup":
                info["lookup_verified"] += r.verified
                info["lookup_accepted"] += r.accepted
            else:
                info["draft_verified"] += r.verified
    return counts, info


@pytest.mark.slow
@pytest.mark.parametrize("late", [False, True], ids=["search before drafting", "search after the read"])
def test_sampling_with_lookup_matches_the_targets_joint(sampling_setup, late, monkeypatch):
    """Chi-square goodness of fit of the first 3 sampled tokens (64 cells, N = 3000, alpha = 0.001; the power
    argument of `test_sampling_exactness.py` holds for this joint too: every cell >= 0.006) with most
    verified tokens copied by lookup (asserted), and both accepted and rejected copies (asserted). Both orders of
    the search: a CPU's (before drafting) and an accelerator's (after the drafting round's read, which drafts in
    copy rounds too: `Speculator.propose`)."""
    monkeypatch.setattr(speculator, "host_reads_stall", lambda device: late)
    target, joint = sampling_setup
    assert joint.min() >= 0.002 and N * joint.min() >= 5
    draft = make_aligned_draft(target, block_size=4)
    counts, info = _sample_counts(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nlookup sampling: p={p_value:.4g} {info}")
    assert p_value >= ALPHA, f"the first-{WINDOW}-token joint differs from the target's (p={p_value:.3g})"
    assert info["lookup_verified"] > max(N, info["draft_verified"]), info
    assert 0.1 * info["lookup_verified"] < info["lookup_accepted"] < 0.9 * info["lookup_verified"], info


@pytest.mark.slow
def test_a_copy_verified_with_a_wrong_q_is_detected(sampling_setup, monkeypatch):
    """The negative control: the copied tokens reported with a uniform `q` (the verifier then runs rejection
    sampling as if each copy had been drawn with probability 1/4, not 1) must fail the same test."""
    target, joint = sampling_setup
    draft = make_aligned_draft(target, block_size=4)
    original = DSparkCandidateGenerator.get_candidates

    def wrong_q(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is None and self._proposal is not None and self._proposal.source == "lookup":
            logits = torch.zeros(1, ids.shape[1] - input_ids.shape[1], VOCAB)
        return ids, logits

    monkeypatch.setattr(DSparkCandidateGenerator, "get_candidates", wrong_q)
    counts, info = _sample_counts(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nlookup with a wrong q: p={p_value:.4g} {info}")
    assert p_value < ALPHA
