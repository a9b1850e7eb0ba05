"""Host synchronisations per round: at most one read in `generate()`, a constant in the engine.

The counter (`tests/sync_counter.py`) models where every tensor would live on an accelerator and counts each
device→host read and blocking host→device copy issued from `src/dspark_hf/`. The setup is the shipped drafts'
configuration (Markov head, confidence head, draft vocabulary subset) on a tiny random target. Each test has a
negative control: putting back one `int(token)` per drafted position must break the bound.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf import DSparkEngine, HardwareAwarePolicy, SamplingParams, SPSProfile, last_generation_stats
from dspark_hf.decoding import drafting, speculator
from dspark_hf.decoding.metrics import EngineMetrics
from sync_counter import SyncCounter

from helpers import make_aligned_draft, make_target

VOCAB = 96
SUBSET = list(range(0, VOCAB, 2))  # half the vocabulary, as a draft subset
MAX_NEW = 40


def _policy():
    # a profile given directly: no measuring, no cache; verifying more tokens costs a little more
    return HardwareAwarePolicy(sps=SPSProfile({1: 1.0, 4: 1.05, 8: 1.15, 16: 1.4, 64: 3.0}))


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, markov=True)


def _draft(target, gamma: int):
    draft = make_aligned_draft(target, "markov", block_size=gamma).set_draft_vocab(SUBSET)
    assert draft.confidence_head is not None and draft.markov_head is not None
    return draft


def _prompt(seed: int = 0, length: int = 10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate_syncs(target, draft, do_sample: bool, extra_files=()) -> tuple[float, SyncCounter, int]:
    kwargs = {"do_sample": True, "top_k": 0} if do_sample else {"do_sample": False}
    torch.manual_seed(0)
    with SyncCounter(extra_files) as counter:
        target.generate(
            _prompt(), max_new_tokens=MAX_NEW, assistant_model=draft, dspark_policy=_policy(), pad_token_id=0, **kwargs
        )
    rounds = sum(1 for r in last_generation_stats(draft).rounds if r.drafted)
    assert rounds >= 5, rounds
    return counter.total / rounds, counter, rounds


def _put_back_int_token(monkeypatch):
    """The negative control: read every drafted token back to the host, as the old loop did."""

    def draw(self, logits, _original=drafting.SharedSampler.draw):
        token = _original(self, logits)
        int(token[0])  # `prev = int(token)`, once per position
        return token

    def rows_draw(self, logits, _original=drafting.PerRowSampler.draw):
        token = _original(self, logits)
        int(token[0])
        return token

    monkeypatch.setattr(drafting.SharedSampler, "draw", draw)
    monkeypatch.setattr(drafting.PerRowSampler, "draw", rows_draw)


@pytest.mark.parametrize("gamma", [4, 8])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_generate_reads_the_device_once_per_round(target, gamma, do_sample):
    draft = _draft(target, gamma)
    draft.generation_config.dspark_guessed_path = (
        False  # the accelerator configuration (the CPU default adds one read: see below)
    )
    per_round, counter, rounds = _generate_syncs(target, draft, do_sample)
    # one-off setup reads (e.g. the draft vocabulary check) are spread over the rounds; allow 2 in total
    assert counter.total <= rounds + 2, (per_round, counter.by_site)
    assert counter.total >= rounds, "the counter must see the round's one read (the packed copy)"


@pytest.mark.parametrize("gamma", [4, 8])
def test_generate_syncs_have_power(target, gamma, monkeypatch):
    """Putting back one `int(token)` per drafted position is detected (about γ + 1 reads a round)."""
    draft = _draft(target, gamma)
    draft.generation_config.dspark_guessed_path = False
    _put_back_int_token(monkeypatch)
    per_round, counter, rounds = _generate_syncs(target, draft, False, extra_files=(__file__,))
    assert counter.total > rounds + 2
    assert per_round >= gamma, (per_round, counter.by_site)


def test_cpu_guessed_path_costs_one_more_read(target):
    """On a CPU the greedy guessed path is on by default; finding its divergence is the one extra read."""
    draft = _draft(target, 8)
    per_round, counter, rounds = _generate_syncs(target, draft, False)
    assert counter.total <= 2 * rounds + 2, (per_round, counter.by_site)


def _engine_syncs(target, draft, rows: int, do_sample: bool, extra_files=()) -> tuple[float, SyncCounter]:
    engine = DSparkEngine(target, draft, policy=_policy(), max_batch_size=rows)
    prompts = [_prompt(seed, 8 + seed % 5)[0].tolist() for seed in range(rows)]
    params = [
        SamplingParams(max_new_tokens=24, do_sample=do_sample, seed=seed if do_sample else None) for seed in range(rows)
    ]
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    engine.step()  # admission and prefill (per-request work, outside the decode rounds)
    with SyncCounter(extra_files) as counter:
        while engine.has_unfinished():
            engine.step()
    rounds = engine.metrics.drafting_rounds
    assert rounds >= 3, rounds
    return counter.total / engine.metrics.rounds, counter


# Per round, whatever R: anchors and (ragged contexts) lengths to the device for the draft, the one packed read
# of the drafted block, the target forward's ids / mask / positions / logits_to_keep built on the host, and the
# greedy acceptance (lengths in, one read out). Step 3 of issue 15 (masks built on the device) lowers it.
ENGINE_BOUND = 9


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_engine_syncs_per_round_do_not_grow_with_rows(target, rows):
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    per_round, counter = _engine_syncs(target, draft, rows, do_sample=False)
    assert per_round <= ENGINE_BOUND, (rows, per_round, counter.by_site)
    assert per_round >= 1, "the counter must see the round's reads"


def test_engine_syncs_have_power(target, monkeypatch):
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    _put_back_int_token(monkeypatch)
    per_round, counter = _engine_syncs(target, draft, 4, do_sample=False, extra_files=(__file__,))
    assert per_round > ENGINE_BOUND, (per_round, counter.by_site)


# ---------------------------------------------------------------------- with prompt lookup on (issue 48)
def _looping_prompt() -> torch.Tensor:
    """A prompt that repeats itself, so prompt lookup finds copies from the first rounds on."""
    return _prompt(3, 6).repeat(1, 3)


def _lookup_generate_syncs(target, draft, do_sample: bool, extra_files=()) -> tuple[SyncCounter, dict, list]:
    kwargs = {"do_sample": True, "top_k": 0} if do_sample else {"do_sample": False}
    torch.manual_seed(0)
    with SyncCounter(extra_files) as counter:
        out = target.generate(
            _looping_prompt(), max_new_tokens=MAX_NEW, assistant_model=draft, dspark_policy=_policy(),
            dspark_lookup=True, pad_token_id=0, **kwargs,
        )  # fmt: skip
    rounds = last_generation_stats(draft).rounds
    kinds = {
        "rounds": len(rounds),
        "copies": sum(r.source == "lookup" for r in rounds),
        "drafted": sum(r.source == "draft" and bool(r.drafted) for r in rounds),
    }
    assert kinds["copies"] >= 2 and kinds["drafted"] >= 2, kinds
    trace = [(r.source, r.drafted[: r.verified], r.accepted) for r in rounds]
    return counter, kinds, [out[0].tolist(), trace]


@pytest.fixture
def accelerator_reads(monkeypatch):
    """The accelerator's choice: a device→host read stalls, so the search waits for the drafting round's read."""
    monkeypatch.setattr(speculator, "host_reads_stall", lambda device: True)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_generate_with_lookup_reads_the_device_once_per_round(target, do_sample, accelerator_reads):
    """With lookup on, where reads stall: the round's new tokens travel in the drafting round's packed read (a
    plain or copy-only round reads them alone), so every round makes one read. The incremental index
    (`LookupIndex`, as the engine's) is fed with those tokens; a copy goes to the target as a slice of the
    sequence, already on the device. The old rescan copied the whole sequence to the host every round."""
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    counter, kinds, _ = _lookup_generate_syncs(target, draft, do_sample)
    assert counter.total <= kinds["rounds"] + 2, (kinds, counter.by_site)  # + the one-off setup reads


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_generate_with_lookup_on_a_cpu_reads_before_searching(target, do_sample):
    """On a CPU (a read is a memory access) the new tokens are read before the search, so a copy round never
    runs the draft: a drafting round then reads twice (1.5 reads a round greedy here, 2.0 sampling). The
    counter sees that second read: this is the control of the test above."""
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    counter, kinds, _ = _lookup_generate_syncs(target, draft, do_sample)
    assert counter.total > kinds["rounds"] + 2, (kinds, counter.by_site)
    assert counter.total <= kinds["rounds"] + kinds["drafted"] + 2, (kinds, counter.by_site)


def test_searching_after_the_read_proposes_what_searching_before_it_does(target, monkeypatch):
    """Both orders search the whole context, so every round proposes, verifies and accepts the same tokens and
    the greedy output is the same; the late search only drafts for nothing in its copy rounds. (Sampling draws
    the draft's random numbers in those rounds too, so its tokens differ; its exactness is
    `tests/decoding/test_lookup.py::test_sampling_with_lookup_matches_the_targets_joint[search after the read]`.)"""
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    _, _, early = _lookup_generate_syncs(target, draft, False)
    monkeypatch.setattr(speculator, "host_reads_stall", lambda device: True)
    _, _, late = _lookup_generate_syncs(target, draft, False)
    assert late == early


def test_generate_with_lookup_syncs_have_power(target, monkeypatch, accelerator_reads):
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    _put_back_int_token(monkeypatch)
    counter, kinds, _ = _lookup_generate_syncs(target, draft, False, extra_files=(__file__,))
    assert counter.total > kinds["rounds"] + 2, (kinds, counter.by_site)


def _lookup_engine_syncs(target, draft, extra_files=()) -> tuple[float, SyncCounter, EngineMetrics]:
    engine = DSparkEngine(target, draft, policy=_policy(), max_batch_size=4, lookup=True)
    for seed in range(4):
        engine.add_request(_looping_prompt()[0].roll(seed).tolist(), SamplingParams(max_new_tokens=24))
    engine.step()  # admission and prefill
    with SyncCounter(extra_files) as counter:
        while engine.has_unfinished():
            engine.step()
    m = engine.metrics
    assert m.lookup_rounds >= 2 and m.drafting_rounds >= 2, (m.lookup_rounds, m.drafting_rounds)
    return counter.total / m.rounds, counter, m


def test_engine_with_lookup_adds_no_read(target):
    """The engine's tokens are on the host already: copy rounds stay within the engine's per-round bound."""
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    per_round, counter, _ = _lookup_engine_syncs(target, draft)
    assert per_round <= ENGINE_BOUND, (per_round, counter.by_site)


def _rescan_the_sequence(monkeypatch):
    """The negative control: search each row's whole sequence on the device every round, as `generate()` did
    before issue 48 (a copy of the sequence to the device and `lookup_continuation`'s copy back)."""
    from dspark_hf.decoding import lookup

    def continuation(self, generated, limit=None):
        ids = torch.tensor(self.ids[: self._prompt] + list(generated), device="cpu")  # as if on the device
        return lookup.lookup_continuation(ids, self.config, limit)

    monkeypatch.setattr(lookup.LookupIndex, "continuation", continuation)


def test_engine_with_lookup_syncs_have_power(target, monkeypatch):
    draft = _draft(target, 5)
    draft.generation_config.dspark_guessed_path = False
    _rescan_the_sequence(monkeypatch)
    per_round, counter, _ = _lookup_engine_syncs(target, draft, extra_files=(__file__,))
    assert per_round > ENGINE_BOUND, (per_round, counter.by_site)
