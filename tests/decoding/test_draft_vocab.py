"""A draft-side vocabulary subset (FR-Spec style) keeps speculative decoding lossless.

What is checked:

* the API: `set_draft_vocab` validation, `frequent_token_ids`, restricted projections equal the full ones'
  columns, the config field;
* greedy identity with subsets through `generate()` and through `DSparkEngine`, including a subset that
  *excludes* the tokens the target picks most often (acceptance drops, the output does not change) and
  logits processors / `suppress_tokens` covering the whole subset (the full-vocabulary fallback);
* sampling exactness with a subset that excludes token 2 of the 4-token target of
  `tests/decoding/test_sampling_exactness.py` (same exact joint by enumeration, same chi-square test, N and alpha,
  whose power against any 0.02 shift of mass is >= 0.98, `test_power_against_a_two_percent_shift` there),
  through `generate()` (with and without temperature / top-k / repetition penalty) and through the engine;
  and two negative controls that must fail the same test: `q` reported over the full vocabulary while the
  token is drawn from the subset, and the subset logits padded with 0 instead of `-inf`;
* save/load keeps the subset, old checkpoints (no buffer) load with the full vocabulary, a config that
  promises a subset without its ids is refused, DeepSpec export drops the subset with a warning.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy import stats
from test_sampling_exactness import (
    ALPHA,
    LOGIT_SCALE,
    MAX_NEW_TOKENS,
    PROCESSED,
    PROMPT,
    SEED,
    WINDOW,
    N,
    _exact_joint,
    _exact_processed_joint,
    _make_draft,
)
from test_sampling_exactness import VOCAB as TINY_VOCAB
from transformers import AutoModel, GenerationConfig, LogitsProcessorList, SuppressTokensLogitsProcessor

from dspark_hf import (
    DSparkConfig,
    DSparkDraftModel,
    DSparkEngine,
    SamplingParams,
    export_deepspec,
    last_generation_stats,
)
from dspark_hf.decoding.drafting import PerRowSampler, sample_block
from dspark_hf.decoding.generation import DSparkCandidateGenerator
from dspark_hf.decoding.target_forward import RequestSampler
from dspark_hf.model.vocab import frequent_token_ids

from helpers import make_aligned_draft, make_target

VOCAB = 96
NUM_PROMPTS = 12
EXCLUDED_TOP = 8  # the "excluding" subset leaves out the target's 8 most frequent greedy tokens
SAMPLING_SUBSET = [0, 1, 3]  # token 2 of the 4-token target is never drafted


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- API
def test_set_draft_vocab_validates_and_round_trips_config():
    target = make_target("llama", vocab_size=VOCAB)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    assert draft.draft_vocab_ids is None and draft.config.draft_vocab_size is None
    assert "draft_vocab_ids" not in draft.state_dict()
    draft.set_draft_vocab([9, 3, 40])
    assert draft.draft_vocab_ids.tolist() == [3, 9, 40] and draft.config.draft_vocab_size == 3  # stored sorted
    assert draft.state_dict()["draft_vocab_ids"].dtype == torch.long
    assert draft.to(torch.float32).draft_vocab_ids.dtype == torch.long  # a dtype cast leaves the ids alone
    draft.set_draft_vocab(torch.arange(VOCAB))  # K = V is allowed
    assert draft.config.draft_vocab_size == VOCAB
    for bad, match in [
        ([1, 2, 2], "unique"),
        ([0, VOCAB], "outside the vocabulary"),
        ([-1, 4], "outside the vocabulary"),
        ([], "between 1 and"),
        (list(range(VOCAB)) + [0], "between 1 and"),
        (torch.tensor([1.0, 2.0]), "integers"),
    ]:
        with pytest.raises(ValueError, match=match):
            draft.set_draft_vocab(bad)
    assert draft.config.draft_vocab_size == VOCAB, "a rejected subset must leave the draft unchanged"
    draft.set_draft_vocab(None)
    assert draft.draft_vocab_ids is None and draft.config.draft_vocab_size is None
    assert "draft_vocab_ids" not in draft.state_dict()
    for k in (0, VOCAB + 1, 2.5):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            DSparkConfig.from_target(target, draft_vocab_size=k)
    # a size without ids: refused by from_target, and by generate() for a draft built directly from a config
    with pytest.raises(ValueError, match="set_draft_vocab"):
        DSparkDraftModel.from_target(target, num_hidden_layers=1, draft_vocab_size=8)
    unfilled = DSparkDraftModel(DSparkConfig.from_target(target, num_hidden_layers=1, draft_vocab_size=8))
    with pytest.raises(ValueError, match="never filled in"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, assistant_model=unfilled.to(target.dtype))


def test_frequent_token_ids():
    seqs = [[5, 5, 5, 1, 2], torch.tensor([2, 2, 7, 1])]  # counts: 5→3, 2→3, 1→2, 7→1
    assert frequent_token_ids(seqs, 2).tolist() == [2, 5]  # tie 5/2 both in; sorted ascending
    assert frequent_token_ids(seqs, 3).tolist() == [1, 2, 5]
    assert frequent_token_ids(seqs, 3, always=[9]).tolist() == [2, 5, 9]  # `always` counts towards k
    assert frequent_token_ids(seqs, 100).tolist() == [1, 2, 5, 7]  # only ids that were seen
    # ties go to the smaller id: 1 and 7 once each
    assert frequent_token_ids([[7, 1, 4, 4]], 2).tolist() == [1, 4]
    # (input_ids, loss_mask) pairs count only the supervised tokens
    pairs = [([5, 5, 5, 1, 1], [0, 0, 0, 1, 1]), (torch.tensor([3, 1]), torch.tensor([True, False]))]
    assert frequent_token_ids(pairs, 1).tolist() == [1]
    assert frequent_token_ids(pairs, 5).tolist() == [1, 3]
    with pytest.raises(ValueError, match="k must be"):
        frequent_token_ids(seqs, 0)
    with pytest.raises(ValueError, match="always"):
        frequent_token_ids(seqs, 1, always=[1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        frequent_token_ids(seqs, 2, vocab_size=6)
    with pytest.raises(ValueError, match="loss-mask"):
        frequent_token_ids([([1, 2], [1])], 2)
    with pytest.raises(ValueError, match="No token ids"):
        frequent_token_ids([], 2)


@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_restricted_projections_are_the_full_ones_columns(head):
    target = make_target("qwen3", vocab_size=VOCAB)
    draft = make_aligned_draft(target, head)
    ids = torch.tensor([0, 5, 17, 60, 95])
    hidden = torch.randn(3, 4, target.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        full = draft.lm_head(hidden)
        features = torch.randn(3, 4, draft.config.markov_rank, dtype=torch.float64)
        full_bias = draft.markov_head.project(features)
        draft.set_draft_vocab(ids)
        sub = draft.draft_logits(hidden)
        torch.testing.assert_close(sub, full[..., ids], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(draft.markov_head.project(features, ids), full_bias[..., ids])
        expanded = draft.expand_draft_logits(sub)
        assert expanded.shape == full.shape
        assert torch.equal(expanded[..., ids], sub)
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[ids] = False
        assert torch.isneginf(expanded[..., outside]).all()
        # a new subset (and an in-place weight change) is picked up by the cached rows
        draft.set_draft_vocab([1, 2])
        torch.testing.assert_close(draft.draft_logits(hidden), full[..., [1, 2]])
        target.lm_head.weight.mul_(2.0)
        torch.testing.assert_close(draft.draft_logits(hidden), 2.0 * full[..., [1, 2]])
        draft.set_draft_vocab(None)
        assert torch.equal(draft.draft_logits(hidden), draft.lm_head(hidden))
        assert torch.equal(draft.expand_draft_logits(full), full)


# ---------------------------------------------------------------------- greedy identity
def _prompts(seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (1, 2 + (i * 5) % 19), generator=gen), 10 + (i * 7) % 15) for i in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def greedy_refs():
    """Per architecture: target, prompts, plain greedy outputs and the subsets to test."""
    refs = {}
    for arch in ("llama", "qwen3"):
        target = make_target(arch, vocab_size=VOCAB, markov=True)
        prompts = _prompts()
        outs = [target.generate(ids, max_new_tokens=n, do_sample=False) for ids, n in prompts]
        generated = [o[0, ids.shape[1] :].tolist() for o, (ids, _) in zip(outs, prompts)]
        top = frequent_token_ids(generated, EXCLUDED_TOP).tolist()
        subsets = {
            "frequent": frequent_token_ids(generated, 32).tolist(),  # most of what the target picks
            "excluding": sorted(set(range(VOCAB)) - set(top)),  # none of its favourite tokens
            "single": [top[0]],
        }
        refs[arch] = (target, prompts, outs, subsets)
    return refs


def _run_generate(target, draft, prompts, **kwargs):
    outs, taus, drafted = [], [], set()
    for ids, max_new in prompts:
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, **kwargs)
        outs.append(target.generate(ids, generation_config=config, assistant_model=draft))
        taus.append(last_generation_stats(draft).tau)
        drafted |= {t for r in last_generation_stats(draft).rounds for t in r.drafted}
    return outs, sum(taus) / len(taus), drafted


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identity_with_subsets(greedy_refs, arch, head):
    target, prompts, expected, subsets = greedy_refs[arch]
    draft = make_aligned_draft(target, head)
    _, tau_full, _ = _run_generate(target, draft, prompts)
    taus = {}
    for name, ids in subsets.items():
        for policy in ("fixed", "threshold:0.3"):
            draft.set_draft_vocab(ids)
            outs, tau, drafted = _run_generate(target, draft, prompts, dspark_policy=policy)
            for out, ref, (p, _) in zip(outs, expected, prompts):
                assert torch.equal(out, ref), f"{arch}/{head}/{name}/{policy}: output differs for {p.tolist()}"
            assert drafted <= set(ids), f"drafted tokens outside the subset: {sorted(drafted - set(ids))}"
            taus[name, policy] = tau
    draft.set_draft_vocab(None)
    _, tau_again, _ = _run_generate(target, draft, prompts)
    assert tau_again == tau_full, "set_draft_vocab(None) must restore the full-vocabulary draft exactly"
    print(f"\n{arch}/{head}: tau full={tau_full:.2f} " + " ".join(f"{k[0]}/{k[1]}={v:.2f}" for k, v in taus.items()))
    if head != "none":  # an aligned draft: the subset changes acceptance, never the output
        assert tau_full >= 2.5
        assert taus["excluding", "fixed"] < tau_full - 0.5, taus
        assert taus["frequent", "fixed"] > taus["excluding", "fixed"], taus


def test_greedy_identity_with_processors_and_fallback(greedy_refs):
    """Repetition penalty runs on the expanded logits; `suppress_tokens` covering the whole subset makes
    every position fall back to the full vocabulary (and the output is still the target's)."""
    target, prompts, _, subsets = greedy_refs["llama"]
    draft = make_aligned_draft(target, "markov")
    subset = subsets["frequent"]
    for kwargs in ({"repetition_penalty": 1.3}, {"suppress_tokens": subset}):
        refs = [
            target.generate(ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=n, **kwargs))
            for ids, n in prompts
        ]
        draft.set_draft_vocab(subset)
        outs, tau, drafted = _run_generate(target, draft, prompts, **kwargs)
        assert all(torch.equal(o, r) for o, r in zip(outs, refs)), kwargs
        if "suppress_tokens" in kwargs:  # nothing of the subset survives: the fallback drafted everything
            assert drafted and not drafted & set(subset)
            assert tau > 1.5, "the full-vocabulary fallback should still draft useful tokens"


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_engine_greedy_identity_with_subsets(greedy_refs, head, layout):
    target, prompts, expected, subsets = greedy_refs["qwen3"]
    draft = make_aligned_draft(target, head)
    work = [(ids[0].tolist(), n) for ids, n in prompts]
    refs = [out[0, len(p) :].tolist() for out, (p, _) in zip(expected, work)]
    taus = {}
    for name in ("full", "frequent", "excluding"):
        draft.set_draft_vocab(subsets.get(name))
        engine = DSparkEngine(target, draft, policy="threshold:0.3", max_batch_size=5, layout=layout)
        outputs = engine.generate([p for p, _ in work], [SamplingParams(max_new_tokens=n) for _, n in work])
        assert [o.token_ids for o in outputs] == refs, f"{head}/{layout}/{name}"
        taus[name] = engine.metrics.tau
    print(f"\nengine {head}/{layout}: " + " ".join(f"{k}={v:.2f}" for k, v in taus.items()))
    assert taus["excluding"] < taus["full"] - 0.3, taus


def test_engine_sample_block_fallback_when_processors_exclude_the_subset():
    target = make_target("llama", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=3)
    subset = list(range(0, VOCAB, 3))
    draft.set_draft_vocab(subset)
    hidden = torch.zeros(2, 3, target.config.hidden_size, dtype=torch.float64)
    base = draft.draft_logits(hidden)
    suppress = RequestSampler(processors=LogitsProcessorList([SuppressTokensLogitsProcessor(subset)]), do_sample=True)
    plain = RequestSampler(do_sample=True, generator=torch.Generator().manual_seed(0))
    block = sample_block(draft, hidden, base, torch.tensor([4, 5]), PerRowSampler([suppress, plain], [[1, 4], [1, 5]]))
    tokens, q = block.tokens, block.logits
    assert not set(tokens[0].tolist()) & set(subset), "row 0 must draft from outside the (suppressed) subset"
    assert set(tokens[1].tolist()) <= set(subset)
    assert torch.isfinite(q[0]).sum(-1).tolist() == [VOCAB - len(subset)] * 3
    assert torch.isfinite(q[1]).sum(-1).tolist() == [len(subset)] * 3


# ---------------------------------------------------------------------- sampling exactness
@pytest.fixture(scope="module")
def sampling_setup():
    target = make_target("llama", vocab_size=TINY_VOCAB, num_layers=2, markov=True, logit_scale=LOGIT_SCALE)
    return target, _exact_joint(target)


def _subset_draft(target):
    return _make_draft(target).set_draft_vocab(SAMPLING_SUBSET)


def _sample(target, draft, seed: int = SEED, **generate_kwargs) -> tuple[np.ndarray, dict]:
    config = GenerationConfig(do_sample=True, max_new_tokens=MAX_NEW_TOKENS, dspark_policy="fixed", **generate_kwargs)
    index = {cell: i for i, cell in enumerate(itertools.product(range(TINY_VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    info = {"accepted": 0, "verified": 0, "drafted": set()}
    torch.manual_seed(seed)
    for _ in range(N):
        out = target.generate(PROMPT, generation_config=config, assistant_model=draft)
        counts[index[tuple(out[0, PROMPT.shape[1] : PROMPT.shape[1] + WINDOW].tolist())]] += 1
        for r in last_generation_stats(draft).rounds:
            info["accepted"] += r.accepted
            info["verified"] += r.verified
            info["drafted"] |= set(r.drafted)
    return counts, info


def _excluded_cells() -> np.ndarray:
    cells = list(itertools.product(range(TINY_VOCAB), repeat=WINDOW))
    return np.array([any(t not in SAMPLING_SUBSET for t in c) for c in cells])


@pytest.mark.slow
def test_sampling_with_a_subset_matches_target_joint(sampling_setup):
    target, joint = sampling_setup
    draft = _subset_draft(target)
    counts, info = _sample(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    excluded = _excluded_cells()
    print(
        f"\nsubset {SAMPLING_SUBSET}: p={p_value:.4g} acceptance={info['accepted'] / info['verified']:.3f} "
        f"excluded-token cells: {counts[excluded].sum()} observed vs {N * joint[excluded].sum():.0f} expected"
    )
    assert p_value >= ALPHA, f"first-{WINDOW}-token joint differs from the target's (p={p_value:.3g})"
    assert info["drafted"] <= set(SAMPLING_SUBSET), "a token outside the subset was drafted"
    assert counts[excluded].sum() > 0.3 * N, "cells with the excluded token must still be produced (by the target)"
    assert info["verified"] > N and info["accepted"] >= 0.3 * info["verified"], info


@pytest.mark.slow
def test_sampling_with_a_subset_and_processors_is_exact(sampling_setup):
    """Temperature, top-k (k = 3 = K) and repetition penalty run on the expanded row (-inf outside S)."""
    target, _ = sampling_setup
    joint = _exact_processed_joint(target)
    draft = _subset_draft(target)
    counts, info = _sample(target, draft, seed=SEED + 1, **PROCESSED)
    nonzero = joint > 0
    assert counts[~nonzero].sum() == 0
    p_value = float(stats.chisquare(counts[nonzero], N * joint[nonzero] / joint[nonzero].sum()).pvalue)
    print(f"\nsubset + processors: p={p_value:.4g} acceptance={info['accepted'] / max(info['verified'], 1):.3f}")
    assert p_value >= ALPHA
    assert info["drafted"] <= set(SAMPLING_SUBSET) and info["accepted"] >= 0.3 * info["verified"], info


@pytest.mark.slow
def test_engine_sampling_with_a_subset_matches_target_joint(sampling_setup):
    target, joint = sampling_setup
    draft = _subset_draft(target)
    torch.manual_seed(SEED + 2)
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=12)
    params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, do_sample=True) for _ in range(N)]
    outputs = engine.generate([PROMPT[0].tolist()] * N, params)
    index = {cell: i for i, cell in enumerate(itertools.product(range(TINY_VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    for out in outputs:
        counts[index[tuple(out.token_ids[:WINDOW])]] += 1
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    m = engine.metrics
    print(f"\nengine, subset: p={p_value:.4g} acceptance={m.drafts_accepted / m.drafts_verified:.3f}")
    assert p_value >= ALPHA
    assert m.drafts_verified > N and m.drafts_accepted >= 0.3 * m.drafts_verified


def _wrong_q(monkeypatch, rewrite):
    """Make the candidate generator report `rewrite(self, input_ids, hidden, tokens, logits)` as `q` while the
    tokens are still drawn by the real (subset) sampler."""
    original = DSparkCandidateGenerator._sample_sequentially

    def patched(self, input_ids, hidden, base_logits):
        tokens, logits, conf = original(self, input_ids, hidden, base_logits)
        return tokens, rewrite(self, input_ids, hidden, tokens, logits), conf

    monkeypatch.setattr(DSparkCandidateGenerator, "_sample_sequentially", patched)


@pytest.mark.slow
def test_q_over_the_full_vocabulary_is_detected(sampling_setup, monkeypatch):
    """Negative control: tokens drawn from the subset, but `q` renormalised over the full vocabulary (the
    unrestricted draft's distribution) must fail the chi-square test."""
    target, joint = sampling_setup
    draft = _subset_draft(target)

    def full_vocab_q(self, input_ids, hidden, tokens, logits):
        prev = torch.cat([input_ids[0, -1:], tokens[:-1]])
        full = self.draft.full_vocab_logits(hidden, self.draft.markov_head.embed(prev), None)
        subset = torch.tensor(SAMPLING_SUBSET)
        torch.testing.assert_close(full[:, subset], logits[:, subset])  # same logits on S, mass outside S
        return full

    _wrong_q(monkeypatch, full_vocab_q)
    counts, info = _sample(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nq over the full vocabulary: p={p_value:.4g} acceptance={info['accepted'] / info['verified']:.3f}")
    assert p_value < ALPHA


@pytest.mark.slow
def test_zero_instead_of_minus_inf_outside_the_subset_is_detected(sampling_setup, monkeypatch):
    """Negative control: the subset's logits padded with 0 (not -inf) outside S, so transformers' `q` puts
    mass on tokens the draft can never propose, must fail the chi-square test."""
    target, joint = sampling_setup
    draft = _subset_draft(target)
    _wrong_q(monkeypatch, lambda self, input_ids, hidden, tokens, logits: torch.nan_to_num(logits, neginf=0.0))
    counts, info = _sample(target, draft)
    p_value = float(stats.chisquare(counts, N * joint).pvalue)
    print(f"\nzero padding outside S: p={p_value:.4g} acceptance={info['accepted'] / info['verified']:.3f}")
    assert p_value < ALPHA


# ---------------------------------------------------------------------- checkpoints
def test_save_load_keeps_the_subset(tmp_path):
    target = make_target("qwen3", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov").set_draft_vocab(range(0, VOCAB, 2))
    draft.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == VOCAB // 2
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["draft_vocab_ids"], torch.arange(0, VOCAB, 2))
    for loaded in (DSparkDraftModel.from_pretrained(tmp_path, target=target), AutoModel.from_pretrained(tmp_path)):
        assert torch.equal(loaded.draft_vocab_ids, draft.draft_vocab_ids)
        assert loaded.config.draft_vocab_size == VOCAB // 2
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    a = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    drafted_a = [r.drafted for r in last_generation_stats(draft).rounds]
    b = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=loaded)
    assert torch.equal(a, b) and drafted_a == [r.drafted for r in last_generation_stats(loaded).rounds]
    model, info = DSparkDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and model.config.draft_vocab_size == VOCAB // 2


def test_old_checkpoint_without_subset_loads_with_full_vocab(tmp_path):
    target = make_target("qwen3", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov")
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("draft_vocab_size", None)  # as written before the field existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "draft_vocab_ids" not in load_file(tmp_path / "model.safetensors")
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.draft_vocab_ids is None and loaded.config.draft_vocab_size is None
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=loaded), ref)
    # a subset set after loading an old checkpoint saves and loads like any other
    loaded.set_draft_vocab([1, 2, 3]).save_pretrained(tmp_path / "again")
    assert DSparkDraftModel.from_pretrained(tmp_path / "again").draft_vocab_ids.tolist() == [1, 2, 3]


def test_config_promising_a_subset_without_ids_is_refused(tmp_path):
    target = make_target("qwen3", vocab_size=VOCAB)
    draft = make_aligned_draft(target, "markov").set_draft_vocab([4, 5, 6])
    draft.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["draft_vocab_ids"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no `draft_vocab_ids`"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_deepspec_export_drops_the_subset_with_a_warning(tmp_path):
    target = make_target("qwen3", vocab_size=VOCAB)
    draft = make_aligned_draft(target, "markov").set_draft_vocab([4, 5, 6])
    with pytest.warns(UserWarning, match="full vocabulary"):
        export_deepspec(draft, tmp_path)
    assert "draft_vocab_ids" not in load_file(tmp_path / "model.safetensors")
    assert "draft_vocab_size" not in json.loads((tmp_path / "config.json").read_text())
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.draft_vocab_ids is None
    assert draft.draft_vocab_ids.tolist() == [4, 5, 6], "exporting must not change the draft itself"
