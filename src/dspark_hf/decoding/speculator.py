"""The [`Speculator`]: one speculative round for R rows, the one implementation both drivers call.

`generate()`'s candidate generator (`dspark_hf.decoding.generation`) is R = 1 and the engine
(`dspark_hf.decoding.engine`) R rows; both hand a round to [`Speculator.propose`], verify what it proposes with the
target (transformers does it for `generate()`, the engine itself), and give the outcome back to
[`Speculator.observe`]. The speculator owns everything in between, chosen once per driver from its resolved
[`SpeculationOptions`]:

* the verification policy and its [`ScheduleContext`] (the SPS profile, measured rates, the payoff guard);
* prompt lookup: each row's incremental [`LookupIndex`], and the [`LookupGate`] that decides, per batch size,
  whether copy rounds pay;
* the drafting backend: the first eligible of `dspark_hf.decoding.backends` (CUDA graphs, the compiled round,
  eager), and the rows' pending target features, ingested when the draft next drafts.

The drivers keep what differs between them: who verifies, where the rows' KV lives (a `KVStore` per call, or a
slot of the engine's `SlotKV`), and the samplers (one call's processors, or each request's own).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..scheduling.policies import ScheduleContext, uniform_length
from .backends import BackendSetup, RoundInputs, choose_backends
from .caches import SlotRow
from .drafting import DraftedBlock, HostRound, empty_round_stats, read_round, round_stats, verified_lengths
from .lookup import LookupGate, LookupIndex
from .options import SpeculationOptions
from .stats import GenerationStats

#: Committed tokens whose features may wait for the draft's next drafting round before they are ingested anyway
#: (a row whose policy has not drafted for a long while).
_PENDING_LIMIT = 256


@dataclass
class DraftRow:
    """One sequence's draft-side state.

    Args:
        store: its draft context: a `KVStore` (`generate()`), or its `SlotRow` of the engine's `SlotKV`.
        prompt (`list[int]`): the prompt's tokens on the host (what prompt lookup indexes first).
        generated (`list[int]`): the tokens generated so far, on the host (the engine's request list itself).
        unread (`Callable`, *optional*): for a driver whose tokens are on the device (`generate()`): returns the
            committed tokens the host does not hold yet (those after `prompt + generated`), as a device tensor.
            Read only when prompt lookup searches (see [`Speculator.propose`] for when).
        stats ([`GenerationStats`], *optional*): where the row's rounds are recorded.
    """

    store: object
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    unread: Callable[[], torch.Tensor] | None = None
    stats: GenerationStats | None = None
    pending: list[torch.Tensor] = field(default_factory=list)  # committed target features not yet ingested
    lookup: LookupIndex | None = None
    pending_tokens: int = 0  # tokens in `pending` (kept by `hold` and `drop_pending`, read every round)

    def hold(self, features: torch.Tensor) -> None:
        """Keep committed tokens' target features `[n, F]` until the draft next ingests."""
        self.pending.append(features)
        self.pending_tokens += features.shape[0]

    def drop_pending(self) -> None:
        """Forget the held features (ingested, or the row is gone)."""
        self.pending = []
        self.pending_tokens = 0


@dataclass
class Proposal:
    """One round's proposal for R rows.

    Args:
        source (`str`): `"draft"`, `"lookup"` (the rows' copies) or `"plain"` (nothing proposed).
        tokens (`list[list[int]]`): each row's proposed tokens on the host (a drafted row's whole block, a copy).
        lengths (`list[int]`): how many of them each row verifies.
        block ([`DraftedBlock`], *optional*): the drafted block on the device (its `q` for verification).
        host ([`HostRound`], *optional*): what the round's one host read brought (a drafting round).
        started, backbone_done, proposed (`float`): `perf_counter` stamps; `started` excludes the catch-up of
            rounds that did not draft, which is not this round's cost.
    """

    source: str
    tokens: list[list[int]]
    lengths: list[int]
    block: DraftedBlock | None = None
    host: HostRound | None = None
    budgets: list[int] = field(default_factory=list)
    started: float = 0.0
    backbone_done: float = 0.0
    proposed: float = 0.0


class Speculator:
    """One speculative round for R rows (see the module docs).

    Args:
        draft ([`DSparkDraftModel`]): the draft, bound to `target`.
        target (`PreTrainedModel`): the model verified against.
        options ([`SpeculationOptions`]): the driver's resolved options (`dspark_hf.decoding.options`).
        setup ([`BackendSetup`], *optional*): the driver's rows and sampling, for choosing the backend once.
        sps ([`SPSProfile`], *optional*): the target's SPS profile for a policy that needs one; measured (and
            cached) on first use when not given.
        stats ([`GenerationStats`], *optional*): where a backend records how it ran (CUDA graphs or why not).
        backends (`list`, *optional*): proposers to use instead of the eligible ones of
            `dspark_hf.decoding.backends` (each with the backends' `ingest` / `propose`): e.g. the oracle proposer of
            `benchmarks/bench_efficiency.py`.
    """

    def __init__(
        self,
        draft,
        target,
        options: SpeculationOptions,
        setup: BackendSetup | None = None,
        sps=None,
        stats=None,
        backends: list | None = None,
    ) -> None:
        self.draft, self.options, self.policy = draft, options, options.policy
        self.gamma = draft.config.block_size
        self.context = ScheduleContext()
        if self.policy.needs_sps and getattr(self.policy, "sps", None) is None:
            if sps is None:
                from ..scheduling.sps import get_sps_profile

                sps = get_sps_profile(target)
            self.context.sps = sps.sps
        self.lookup = options.lookup
        self.gate = LookupGate() if self.lookup is not None else None
        self.stats = stats
        self.backends = backends or choose_backends(draft, options, setup or BackendSetup(), stats=stats)
        # rows with `unread` tokens: search after the drafting round's read, not before it (see `propose`)
        self.search_after_read = host_reads_stall(draft.device)

    # ------------------------------------------------------------------ the round
    def propose(self, rows: list[DraftRow], anchors, budgets: list[int], eos: list, **sampling) -> Proposal:
        """The draft side of one round for `rows` (`anchors`: each row's last token, `[R]` on the draft's device
        or a host list, copied only when the round drafts; `budgets`: the most tokens each row may verify;
        `eos`: each row's stop tokens). `sampling`: the [`RoundInputs`] fields `head` (the driver's sequential
        head), `greedy` and `generator`. Returns a [`Proposal`]:

        1. copy: with prompt lookup on and the gate allowing it, a round in which some row's last tokens recur in
           its context verifies the copies (at the length that pays) and does not draft;
        2. plan: the policy may fix one length before drafting; `0`, or no budget anywhere, makes a plain round;
        3. ingest: the rows' pending target features enter the draft's context (catch-up is not this round's cost);
        4. draft: the first backend that takes the round drafts the block and its scores, on the device;
        5. read: the round's one device→host copy (tokens and scores);
        6. lengths: the policy's lengths from the survival matrix, clipped to each row's budget and first EOS.

        Rows whose newest tokens are on the device only (`generate()`: transformers' verification picks the
        target's token there) must read them before searching. On a CPU that read costs nothing and step 1 makes
        it; where a read waits for the device (`host_reads_stall`) the search moves after step 5 instead, whose
        one copy carries those tokens: a copy found then is verified instead of the draft (which ran for nothing).
        Either way the search sees the whole context, so the proposals, and the output, are the same.
        """
        started = time.perf_counter()
        self.context.planned_length = None
        late = self.search_after_read and any(r.unread is not None for r in rows) and self._may_copy(rows, budgets)
        copies = None if late else self._copies(rows, budgets)  # 1
        if copies is not None:
            return self._undrafted(rows, "lookup", copies, budgets, started)
        if max(budgets) > 0:  # 2
            self.context.planned_length = self.policy.plan_length(len(rows), self.gamma, self.context)
        if max(budgets) <= 0 or self.context.planned_length == 0:
            copies = self._search(rows, budgets) if late else None  # no draft to carry the read: its own
            if copies is not None:
                return self._undrafted(rows, "lookup", copies, budgets, started)
            return self._undrafted(rows, "plain", [[] for _ in rows], budgets, started)
        started += self.ingest(rows)  # 3
        if not isinstance(anchors, torch.Tensor):
            anchors = torch.tensor(anchors, device=self.draft.device)
        inputs = RoundInputs(*_stores(rows), anchors, self.context.planned_length, **sampling)
        drafted = next(d for backend in self.backends if (d := backend.propose(inputs)) is not None)  # 4
        unread = [(row, row.unread()) for row in rows if row.unread is not None] if late else []
        host = read_round(drafted.block, drafted.scores, torch.cat([t for _, t in unread]) if unread else None)  # 5
        if late:
            _learn(unread, host.extra)
            copies = self._search(rows, budgets, read=False)
            if copies is not None:  # verified instead of the draft
                done = time.perf_counter()
                lengths = [len(c) for c in copies]
                return Proposal("lookup", copies, lengths, None, None, budgets, started, drafted.backbone_done, done)
        lengths = verified_lengths(self.policy, self.context, host, budgets, eos)  # 6
        done = time.perf_counter()
        return Proposal(
            "draft", host.tokens, lengths, drafted.block, host, budgets, started, drafted.backbone_done, done
        )

    def observe(
        self, rows: list[DraftRow], proposal: Proposal, accepted: list[int], forward_tokens: int, rest_seconds: float
    ) -> None:
        """After verification: each row's [`RoundStats`], then the gate's and the policy's feedback.

        Args:
            accepted (`list[int]`): proposed tokens each row kept (each row also emitted one target token).
            forward_tokens (`int`): tokens the verification forward computed (padding included).
            rest_seconds (`float`): the round's seconds after the proposal (verification, commit).
        """
        drafted = proposal.source == "draft"
        for i, row in enumerate(rows):
            if drafted and proposal.budgets[i] > 0:  # a row without budget drafted nothing useful
                stats = round_stats(proposal.host, i, proposal.lengths[i])
            else:
                stats = empty_round_stats()
            if proposal.source == "lookup" and proposal.tokens[i]:
                stats.source, stats.drafted, stats.verified = "lookup", proposal.tokens[i], proposal.lengths[i]
                self.gate.record(proposal.lengths[i], accepted[i])
            stats.accepted = accepted[i]
            stats.draft_time = proposal.backbone_done - proposal.started
            stats.sequential_time = proposal.proposed - proposal.backbone_done
            stats.verify_time = rest_seconds
            if row.stats is not None:
                row.stats.rounds.append(stats)
        if self.gate is not None:
            seconds = proposal.proposed - proposal.started + rest_seconds
            self.gate.observe(len(rows), proposal.source == "lookup", len(rows) + sum(accepted), seconds)
        if proposal.source == "lookup":  # the policy weighs drafting against plain rounds; a copy is neither
            return
        host = proposal.host
        self.policy.observe_round(
            self.context,
            rows=len(rows),
            forward_tokens=forward_tokens,
            rest_seconds=rest_seconds,
            draft_seconds=proposal.proposed - proposal.started if drafted else None,
            survival=torch.tensor(host.survival) if drafted and host.confidence_logits else None,
            verified=proposal.lengths,
            accepted=accepted,
        )

    # ------------------------------------------------------------------ the draft's context
    def ingest(self, rows: list[DraftRow]) -> float:
        """Bring the rows' draft contexts up to date with every token they committed (one draft pass).

        Returns the seconds of it spent on tokens older than the last round (what rounds that did not draft left
        to catch up): a drafting round's own cost, which the policy weighs, excludes them, or a policy that paused
        drafting would see its first drafting round as dear and never resume.
        """
        rows = [r for r in rows if r.pending]
        if not rows:
            return 0.0
        start = time.perf_counter()
        features = [torch.cat(r.pending) if len(r.pending) > 1 else r.pending[0] for r in rows]
        total = sum(f.shape[0] for f in features)
        latest = sum(r.pending[-1].shape[0] for r in rows)
        stores, _, slots = _stores(rows)
        self.backends[0].ingest(stores, features, slots)
        for row in rows:
            row.drop_pending()
        return (time.perf_counter() - start) * (1 - latest / total)

    def _undrafted(self, rows, source: str, tokens: list[list[int]], budgets, started: float) -> Proposal:
        """A copy or plain round: the draft does not run, except to bound the features rows hold back."""
        self.ingest([r for r in rows if r.pending_tokens >= _PENDING_LIMIT])
        now = time.perf_counter()
        return Proposal(source, tokens, [len(t) for t in tokens], None, None, budgets, started, now, now)

    # ------------------------------------------------------------------ prompt lookup
    def _copies(self, rows: list[DraftRow], budgets: list[int]) -> list[list[int]] | None:
        """Each row's prompt-lookup copy (`[]` where its last tokens do not recur), capped at its budget; `None`
        when lookup is off, no row has a copy, or the [`LookupGate`] declines copying at this batch size."""
        return self._search(rows, budgets) if self._may_copy(rows, budgets) else None

    def _may_copy(self, rows: list[DraftRow], budgets: list[int]) -> bool:
        """Whether this round may copy: lookup on, some budget, the gate allows this batch size, and a copy for
        every row would pay."""
        if self.lookup is None or max(budgets) <= 0 or not self.gate.allows(len(rows)):
            return False
        if self._copy_length([[0] * b for b in budgets]) == 0:  # not even a copy for every row would pay: no search
            self.gate.probing = False
            return False
        return True

    def _search(self, rows: list[DraftRow], budgets: list[int], read: bool = True) -> list[list[int]] | None:
        """The rows' copies at the length that pays, `None` when there is none (`read`: first bring the rows'
        `unread` tokens to the host, one read each)."""
        copies = []
        for row, budget in zip(rows, budgets):
            if read and row.unread is not None:
                row.generated.extend(row.unread().tolist())
            if row.lookup is None:
                row.lookup = LookupIndex(row.prompt, self.lookup)
            copies.append(row.lookup.continuation(row.generated, budget) if budget > 0 else [])
        length = self._copy_length(copies) if any(copies) else 0
        if length == 0:
            self.gate.probing = False  # nothing was tried: a probe waits for a round that can copy
            return None
        return [c[:length] for c in copies]

    def _copy_length(self, copies: list[list[int]]) -> int:
        """How many copied tokens a copy round verifies per row: where the target's SPS profile is known, the
        one length `L` that maximises expected tokens per second of the round ([`uniform_length`]: a padded
        forward computes `rows · (1 + L)` tokens; the gain is the copies' expected accepted tokens, from the
        gate's per-position acceptance), `0` when no length pays; without a profile, the longest copy."""
        longest = max(map(len, copies))
        profile = getattr(self.policy, "sps", None)
        sps = profile.sps if profile is not None else self.context.sps
        if sps is None:
            return longest
        rows = len(copies)
        measured = {b: statistics.median(ts) for (r, b), ts in self.context.round_seconds.items() if r == rows}
        return uniform_length(self.gate.survival(copies), rows, sps, measured=measured)


def host_reads_stall(device: torch.device) -> bool:
    """Whether a device→host read waits for the device's queued work (an accelerator), so that a round should
    read once; on a CPU it is a memory access, and a second small read costs less than a wasted draft."""
    return torch.device(device).type != "cpu"


def _learn(unread: list[tuple[DraftRow, torch.Tensor]], values: list[int]) -> None:
    """Append the read `values` (the rows' unread tokens, in row order) to the rows' host lists."""
    at = 0
    for row, tokens in unread:
        row.generated.extend(values[at : at + tokens.shape[0]])
        at += tokens.shape[0]


def _stores(rows: list[DraftRow]) -> tuple[object, list, list[int] | None]:
    """The rows' contexts as the backends read them: `(stores, each row's store, slots)` — the engine's `SlotKV`
    with the rows' slots, or one `KVStore` per row."""
    own = [r.store for r in rows]
    if isinstance(own[0], SlotRow):
        return own[0].store, own, [s.slot for s in own]
    return own, own, None
