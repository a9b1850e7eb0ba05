"""Verification policies: how many of the drafted tokens to send to the target each round.

A policy sees, for each active request `r`, the survival probabilities `a[r, k] = Π_{i≤k} c[r, i]` of the
drafted block (`c` = calibrated confidences) and returns a length `ℓ_r ∈ {0..γ}`; the first `ℓ_r` drafted
tokens are verified.

**Why this stays lossless.** `c[r, k]` is computed from the backbone state and the *previous* drafted
token, never from token `k` itself. A policy that decides whether to verify position `k` from `a[r, ≤k]`
only (scanning left to right and stopping at the first "no") therefore never lets the value of a token
decide whether that same token is verified. Every policy here has this prefix property; a global search
that peeks past a "no" does not, and biases sampling (see the design notes, Appendix A counterexample).

Policies are small objects around the pure tensor functions of `dspark_hf.scheduling.lengths`, so they can be
table-tested and composed; the two that weigh drafting against plain rounds by measurement share one payoff guard
(`dspark_hf.scheduling.payoff`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .lengths import (  # noqa: F401 - the pure functions, importable from here as before
    best_capacity,
    blend_survival,
    check_profile,
    confidence_threshold_lengths,
    fixed_lengths,
    hardware_aware_lengths,
    nearest,
    remember,
    sps_function,
    survival_probabilities,
    threshold_lengths,
    top_k_lengths,
    uniform_length,
)
from .payoff import PayoffGuard, PayoffState  # noqa: F401 - PayoffState: importable from here as before
from .sps import SPSProfile


@dataclass
class ScheduleContext:
    """What a policy may know besides the current survival probabilities.

    Args:
        sps (`Callable[[int], float]`, *optional*): verification steps per second at `B` tokens.
        background_tokens (`int`): tokens of other requests sharing the verification forward.
        previous_survival (`torch.Tensor`, *optional*): the previous round's survival probabilities
            `(R', γ)` (for the lagged policy).
        survival_estimate (`torch.Tensor`, *optional*): running mean survival per block position `(γ,)` over
            earlier rounds (for the uniform policy).
        draft_seconds (`dict[int, list[float]]`): recent drafting times per number of requests.
        round_seconds (`dict[tuple[int, int], list[float]]`): recent times of the rest of a round (forward
            included) per `(requests, tokens computed)`.
        since_plain (`dict[int, int]`): rounds since the last plain round, per number of requests.
        predicted_accepted, realized_accepted (`float`): drafted tokens expected to be accepted from the
            survival probabilities, and accepted in fact, over recent rounds (decayed sums; they also fade in
            rounds that do not draft, so old evidence does not rule for good).
        planned_length (`int`, *optional*): the length a policy fixed before this round's drafting.
        guard ([`PayoffGuard`], *optional*): the measured payoff of drafting against plain rounds per number of
            requests, made by the first policy that weighs it ([`AdaptivePolicy`], [`UniformHardwareAwarePolicy`]);
            `payoff`, `probe_wait` and `probing` are views of it.
    """

    sps: Callable[[int], float] | None = None
    background_tokens: int = 0
    previous_survival: torch.Tensor | None = None
    survival_estimate: torch.Tensor | None = None
    draft_seconds: dict[int, list[float]] = field(default_factory=dict)
    round_seconds: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    since_plain: dict[int, int] = field(default_factory=dict)
    predicted_accepted: float = 0.0
    realized_accepted: float = 0.0
    planned_length: int | None = None
    guard: PayoffGuard | None = None

    @property
    def payoff(self) -> dict[int, PayoffState]:
        """`dict[int, PayoffState]`: the guard's measured rates per number of requests (empty without a guard)."""
        return self.guard.states if self.guard is not None else {}

    @property
    def probe_wait(self) -> dict[int, int]:
        """`dict[int, int]`: rounds to wait before the next probe, per number of requests."""
        return self.guard.waits if self.guard is not None else {}

    @property
    def probing(self) -> bool:
        """`bool`: whether the planned round is a probe."""
        return self.guard is not None and self.guard.probing


class VerificationPolicy:
    """Base class: subclasses implement `choose_lengths(survival, context) -> lengths`.

    `needs_confidence` tells the drafter whether the confidence head must run (a fixed policy does not);
    `needs_sps` whether the policy needs the target's SPS profile.
    """

    name = "policy"
    needs_confidence = True
    needs_sps = False

    def choose_lengths(
        self, survival: torch.Tensor, context: ScheduleContext | None = None
    ) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def plan_length(self, rows: int, gamma: int, context: ScheduleContext) -> int | None:
        """A length for every request fixed *before* drafting (`0`: skip drafting), or `None` (the default:
        the length is chosen from the drafted block)."""
        return None

    def observe_round(
        self,
        context: ScheduleContext,
        rows: int,
        forward_tokens: int,
        rest_seconds: float,
        draft_seconds: float | None = None,
        survival: torch.Tensor | None = None,
        verified: list[int] | None = None,
        accepted: list[int] | None = None,
    ) -> None:
        """Learn from a finished round (the default: nothing). `survival` is the round's `(rows, γ)` matrix
        when it drafted; `rest_seconds` is the round's time besides drafting; `verified` and `accepted`
        are the drafts each request verified and kept."""


def planned_lengths(policy, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
    """The lengths of a policy that fixes one length before drafting: the one it planned for this round
    (`context.planned_length`), or, called outside a driver that planned it, `policy.plan_length` now."""
    context = context or ScheduleContext()
    length = context.planned_length
    if length is None:
        length = policy.plan_length(survival.shape[0], survival.shape[-1], context)
    return fixed_lengths(survival, length)


@dataclass
class FixedPolicy(VerificationPolicy):
    """Verify `n` drafted tokens every round (`n=None`: the whole block)."""

    n: int | None = None
    name = "fixed"
    needs_confidence = False

    def plan_length(self, rows: int, gamma: int, context: ScheduleContext) -> int | None:
        """`n` is known before drafting: only that many positions are drafted (`None`: the whole block)."""
        return None if self.n is None else min(self.n, gamma)

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return fixed_lengths(survival, survival.shape[-1] if self.n is None else self.n)


@dataclass
class AdaptivePolicy(VerificationPolicy):
    """Draft and verify `n` tokens a round while that emits more tokens per second than plain rounds do, as
    measured in this very call (or engine); otherwise decode plainly and try drafting again after a back-off.

    A payoff guard ([`PayoffGuard`]) for a fixed length: it compares what drafting really earns here (tokens
    emitted over the whole round's time, drafting included) with plain decoding's measured rate, so on text the
    draft predicts poorly, or where verification is dear, it decodes plainly instead of paying for drafts that
    are not accepted. It drafts `warmup_drafts` rounds first (a reply's opening is often its most predictable),
    measures `plain_samples` plain rounds, then takes the faster arm each round; while plain wins it probes one
    drafting round after `explore` plain rounds (the wait doubling up to `explore_max` while probes do not turn
    the verdict), and while drafting wins one plain round in every `refresh_every` re-measures the alternative.

    Lossless: the length is fixed before the round drafts, from earlier rounds only. Needs no confidence
    head and no SPS profile. Measured per batch size (the engine's rounds at `R` rows are compared with plain
    rounds at `R` rows).

    Args:
        n (`int`, *optional*, defaults to 4): drafts verified in a drafting round (`None`: the whole block).
        smoothing (`float`, *optional*, defaults to 0.1): decay of the drafting sums per drafting round.
        plain_smoothing (`float`, *optional*, defaults to 0.25): decay of the plain sums per plain round.
        probe_weight (`float`, *optional*, defaults to 0.5): decay of the drafting sums at a probe.
        plain_samples (`int`, *optional*, defaults to 2): plain rounds measured after the warm-up drafts.
        warmup_drafts (`int`, *optional*, defaults to 3): drafting rounds measured first, before any comparison.
        explore (`int`, *optional*, defaults to 8): plain rounds before the first probe.
        explore_max (`int`, *optional*, defaults to 64): the longest wait between probes.
        refresh_every (`int`, *optional*, defaults to 16): drafting rounds between plain re-measurements.
    """

    n: int | None = 4
    smoothing: float = 0.1
    plain_smoothing: float = 0.25
    probe_weight: float = 0.5
    plain_samples: int = 2
    warmup_drafts: int = 3
    explore: int = 8
    explore_max: int = 64
    refresh_every: int = 16
    name = "adaptive"
    needs_confidence = False

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise ValueError(f"adaptive: n must be >= 1, got {self.n}.")
        if not all(0 < w <= 1 for w in (self.smoothing, self.plain_smoothing, self.probe_weight)):
            raise ValueError("adaptive: smoothing, plain_smoothing and probe_weight must be in (0, 1].")

    def _guard(self, context: ScheduleContext) -> PayoffGuard:
        if context.guard is None:
            context.guard = PayoffGuard(
                after=None,  # the verdict is taken each round after the warm-up drafts (`_losing`), not vetoed
                margin=0.0,
                smoothing=self.smoothing,
                plain_smoothing=self.plain_smoothing,
                probe_weight=self.probe_weight,
                explore=self.explore,
                explore_max=self.explore_max,
            )
        return context.guard

    def _losing(self, guard: PayoffGuard, state: PayoffState) -> bool:
        """Past the warm-up, drafting has not emitted more per second than plain rounds."""
        return state.drafts >= self.warmup_drafts and not guard.pays(state)

    def plan_length(self, rows: int, gamma: int, context: ScheduleContext) -> int:
        guard = self._guard(context)
        state = guard.states.setdefault(rows, PayoffState())
        length = gamma if self.n is None else min(self.n, gamma)
        if state.drafts < self.warmup_drafts:
            return length
        if state.plains < self.plain_samples:
            return 0
        if guard.pays(state):  # drafting pays here
            return 0 if state.streak >= self.refresh_every else length
        return length if guard.probe_due(rows) else 0  # a probe, or plain decoding

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return planned_lengths(self, survival, context)

    def observe_round(
        self,
        context,
        rows,
        forward_tokens,
        rest_seconds,
        draft_seconds=None,
        survival=None,
        verified=None,
        accepted=None,
    ) -> None:
        guard = self._guard(context)
        state = guard.states.setdefault(rows, PayoffState())
        seconds = rest_seconds + (draft_seconds or 0.0)
        if seconds <= 0:
            return
        tokens = rows + sum(accepted or ())  # every round emits one target token per row
        if draft_seconds is not None and verified and sum(verified) > 0:
            probe = self._losing(guard, state) and guard.probe_due(rows)
            guard.add_round(rows, True, tokens, seconds, probe=probe)
            state.streak += 1
            if probe:  # the verdict stands: wait twice as long; it turned: back to the shortest wait
                guard.since[rows] = 0
                guard.end_probe(rows)
        else:
            sample = state.plains < self.plain_samples  # a measuring round, not one the verdict chose
            guard.add_round(rows, False, tokens, seconds)
            state.streak = 0
            if not sample and self._losing(guard, state):  # only rounds the losing verdict chose count as waited
                guard.since[rows] = guard.since.get(rows, 0) + 1


@dataclass
class ThresholdPolicy(VerificationPolicy):
    """Survival rule: verify while the running product of calibrated confidences stays `>= threshold`.

    This is *not* DeepSpec's rule (that is [`ConfidenceThresholdPolicy`]): at confidence 0.9 everywhere and
    threshold 0.7 it verifies 3 tokens (0.9, 0.81, 0.729), DeepSpec's rule all 7.
    """

    threshold: float = 0.5
    name = "threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}.")

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return threshold_lengths(survival, self.threshold)


@dataclass
class ConfidenceThresholdPolicy(VerificationPolicy):
    """DeepSpec's rule: verify up to (not including) the first position whose calibrated confidence is `< threshold`.

    DeepSpec's evaluator (`confidence_threshold`) compares each position's own confidence `c_k`, not the running
    product; [`ThresholdPolicy`] is the product ("survival") rule.
    """

    threshold: float = 0.5
    name = "confidence_threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}.")

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return confidence_threshold_lengths(survival, self.threshold)


@dataclass
class HardwareAwarePolicy(VerificationPolicy):
    """Paper Algorithm 1 ([`hardware_aware_lengths`]) on the target's measured SPS curve.

    Args:
        sps ([`SPSProfile`], *optional*): the target's profile; by default the cached profile of the target
            on this device (measured once, in seconds, on first use).
        background_tokens (`int`, *optional*, defaults to 0): tokens of other requests assumed to share each
            verification forward (single-request `generate()` models the rest of a batch this way).
    """

    sps: SPSProfile | None = None
    background_tokens: int = 0
    name = "hardware_aware"
    needs_sps = True

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        context = context or ScheduleContext()
        sps = sps_function(self.sps, context)
        return hardware_aware_lengths(survival, sps, self.background_tokens + context.background_tokens)

    def observe_round(self, context, rows, forward_tokens, rest_seconds, **kwargs) -> None:
        check_profile(self.sps, context, rows, forward_tokens + self.background_tokens, rest_seconds)


@dataclass
class LaggedHardwareAwarePolicy(HardwareAwarePolicy):
    """Paper §5.2: capacity `K` from the *previous* round, then the current top-`K` candidates.

    `K` comes from an unconstrained global search ([`best_capacity`]) over the previous round's survival
    probabilities, so it can jump past a cliff of a jagged SPS curve where the early-stopping search gets
    stuck. It stays lossless because `K` is fixed before any current token is drafted, and the top-`K`
    admission of `(r, j)` only compares it with candidates of higher survival, which never include
    anything computed from `x[r, j]`. The first round has no history and uses a geometric prior
    survival `prior ** (j + 1)`.

    Args:
        prior (`float`, *optional*, defaults to 0.7): per-position survival assumed before any round.
    """

    prior: float = 0.7
    name = "hardware_aware_lagged"

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        context = context or ScheduleContext()
        sps = sps_function(self.sps, context)
        previous = context.previous_survival
        if previous is None:
            gamma = survival.shape[-1]
            powers = torch.arange(1, gamma + 1, dtype=torch.float64)
            previous = (self.prior**powers).expand(survival.shape[0], gamma)
        capacity = best_capacity(previous, sps, self.background_tokens + context.background_tokens)
        return top_k_lengths(survival, capacity)


@dataclass
class UniformHardwareAwarePolicy(HardwareAwarePolicy):
    """One length for the whole batch, fixed before drafting, from measured costs ([`uniform_length`]).

    Built for the engine's padded verification forward, whose cost is `rows · (1 + max ℓ)` tokens: the
    token-by-token admission of Algorithm 1 prices a ragged batch as if it were packed, and so it
    under-verifies the rows that padding would carry for free. This policy picks `L` from the running mean
    survival of earlier rounds, rescaled by how many of the drafts it verified were really accepted (the
    confidences' calibration drifts with the traffic), and from costs it measures as it runs (medians of
    the last `window` rounds): the drafting step per batch size, and the rest of a round per batch size and
    forward size. A forward size not measured yet costs the measured plain round scaled by the SPS
    profile's cost ratio. The first `plain_samples` rounds at a new batch size are plain ones (`L = 0`),
    and so is one in every `refresh_every` after, so that every length is weighed against recently measured
    plain rounds. When no length pays for the draft, `L = 0` and the round skips drafting altogether, so
    under heavy load it costs about what plain decoding costs.

    The rescaling ratio is `(realized + prior_weight) / (predicted + prior_weight)`: `prior_weight` drafts'
    worth of evidence that the confidences are calibrated. Without it, a few drafting rounds that happened to
    accept nothing made the ratio 0, every later plan `L = 0`, and, since only drafting rounds add evidence,
    the policy never drafted again whatever the draft could do. Rounds that do not draft also fade the
    evidence (by `idle_decay` each), so a ratio learned long ago drifts back towards the confidences' own
    promise and is tested again by a drafting round once that promise pays.

    **Probes and the payoff guard** ([`PayoffGuard`], shared with [`AdaptivePolicy`] and the engine's lookup gate).
    Survival and costs are only measured by drafting rounds, so a verdict "no length pays" would stand for good on
    whatever the last drafting rounds measured (often a cold one). So after `explore` plain rounds at a batch size
    in which no length paid, the policy drafts one round at the best length that drafts (a probe); a probe that
    does not turn the guard's comparison doubles the wait (up to `explore_max`), one that does resets it. And
    since the plan is a model, the guard also keeps what drafting and plain rounds really emitted per second at
    each batch size: once `guard_after` drafting rounds at a size have not emitted `guard_margin` more tokens per
    second, the plan there is 0 until a probe turns the comparison; that verdict also stands for every larger
    batch size that has not measured a gain of its own (`inherit_veto`).

    Lossless like the lagged policy: `L` is fixed before any current token is drafted.

    Args:
        prior (`float`, *optional*, defaults to 0.7): per-position survival assumed before any round.
        smoothing (`float`, *optional*, defaults to 0.2): weight of the newest round in the running mean.
        window (`int`, *optional*, defaults to 16): timings kept per key (their median is used).
        plain_samples (`int`, *optional*, defaults to 3): plain rounds measured at a batch size before drafting.
        refresh_every (`int`, *optional*, defaults to 16): after this many drafting rounds at a batch size, one
            plain round re-measures the alternative (the machine's load drifts).
        prior_weight (`float`, *optional*, defaults to 1.0): pseudo-count, in accepted drafts, of calibrated
            confidences in the rescaling ratio (`0`: the bare ratio, which can lock at 0).
        idle_decay (`float`, *optional*, defaults to 0.95): factor on the ratio's evidence per round that did
            not draft (`1`: evidence changes only when drafting).
        explore (`int`, *optional*, defaults to 16): plain rounds, while no length pays, before the first
            probe at a batch size (`0`: never probe).
        explore_max (`int`, *optional*, defaults to 256): the longest wait between probes.
        guard_after (`int`, *optional*, defaults to 4): drafting rounds measured at a batch size before the
            payoff guard may overrule the plan there (`0`: no guard).
        guard_smoothing (`float`, *optional*, defaults to 0.1): decay of the guard's drafting sums per drafting
            round (its plain sums decay by `plain_smoothing`).
        plain_smoothing (`float`, *optional*, defaults to 0.05): decay of the guard's plain sums per plain round.
            Plain rounds are many and alike, so a long memory costs nothing and keeps a few slow ones (a busy
            moment of the machine) from making drafting look like a gain.
        guard_margin (`float`, *optional*, defaults to 0.1): how much more per second drafting rounds must emit
            to count as a gain (round times scatter by ±10% on a shared host; a verdict that flips on noise drafts
            in runs of losing rounds).
        probe_weight (`float`, *optional*, defaults to 0.5): decay of the guard's drafting sums at a probe, so
            that one probe that pays can turn the comparison.
        inherit_veto (`bool`, *optional*, defaults to `True`): a guard's verdict against drafting at a batch size
            stands for every larger one unless that size measured a gain of its own: a server's batch size changes
            with every arrival and departure, and the small sizes it passes through settle the question for the
            large ones (a verified draft token costs at least as much in a larger batch, while a row's expected
            gain does not depend on the batch).
        scale_by_stake (`bool`, *optional*, defaults to `True`): the guard's margin and the waits between probes
            at a batch size shrink with what a drafting round costs there over a plain one (capped at 1, see
            [`PayoffGuard`]). With one request on a CPU a drafting round costs ~20% more than a plain one; with
            the margin and waits as set for batches, one stretch the draft predicted poorly kept the policy from
            drafting for the rest of a reply (1.15x plain decoding where `fixed:4` made 1.34x, measured
            2026-12-06). In a batch, where a drafting round costs as much as a plain one or more, nothing changes.
    """

    prior: float = 0.7
    smoothing: float = 0.2
    window: int = 16
    plain_samples: int = 3
    refresh_every: int = 16
    prior_weight: float = 1.0
    idle_decay: float = 0.95
    explore: int = 16
    explore_max: int = 256
    guard_after: int = 4
    guard_smoothing: float = 0.1
    plain_smoothing: float = 0.05
    probe_weight: float = 0.5
    inherit_veto: bool = True
    guard_margin: float = 0.1
    scale_by_stake: bool = True
    name = "hardware_aware_uniform"

    def plan_length(self, rows: int, gamma: int, context: ScheduleContext) -> int:
        sps = sps_function(self.sps, context)
        prior = self.prior ** torch.arange(1, gamma + 1, dtype=torch.float64)
        estimate = context.survival_estimate
        if estimate is None:
            estimate = prior
        elif estimate.numel() != gamma:  # positions never drafted yet continue the last estimate at the prior's rate
            known = estimate[:gamma]
            estimate = torch.cat([known, known[-1] * prior[: gamma - known.numel()]])
        predicted = context.predicted_accepted + self.prior_weight
        if context.survival_estimate is not None and predicted > 0:
            # the confidences' calibration drifts with the traffic: rescale them by what was really accepted
            ratio = (context.realized_accepted + self.prior_weight) / predicted
            estimate = (estimate * ratio).clamp(max=1.0)
        plain = context.round_seconds.get((rows, rows + self.background_tokens + context.background_tokens), [])
        if len(plain) < self.plain_samples or context.since_plain.get(rows, 0) >= self.refresh_every:
            return 0  # (re-)measure a plain round at this batch size: the alternative every length must beat
        measured = {b: statistics.median(ts) for (r, b), ts in context.round_seconds.items() if r == rows}
        kwargs = dict(
            draft_seconds=nearest(context.draft_seconds, rows),
            background_tokens=self.background_tokens + context.background_tokens,
            measured=measured,
        )
        length = uniform_length(estimate, rows, sps, **kwargs)
        guard = self._guard(context)
        if length and guard.vetoed_here(rows):
            length = 0  # drafting rounds here did not really emit more per second (by the margin)
        if self.inherit_veto and guard.vetoed_below(rows):
            return 0  # drafting measured a loss at a smaller batch size: no plan and no probe here either
        if length == 0 and self.explore and gamma > 0 and guard.probe_due(rows):
            guard.probing = True  # `observe_round` weighs the probe and sets the next wait
            return uniform_length(estimate, rows, sps, min_length=1, **kwargs)
        return length

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return planned_lengths(self, survival, context)

    def observe_round(
        self,
        context,
        rows,
        forward_tokens,
        rest_seconds,
        draft_seconds=None,
        survival=None,
        verified=None,
        accepted=None,
    ) -> None:
        drafted = survival is not None and survival.numel() and verified is not None and sum(verified) > 0
        if not drafted:  # evidence fades while the policy does not draft, so an old verdict is tried again
            context.predicted_accepted *= self.idle_decay
            context.realized_accepted *= self.idle_decay
        guard = self._guard(context)
        guard.since[rows] = 0 if draft_seconds is not None else guard.since.get(rows, 0) + 1
        own_draft = draft_seconds if drafted else None
        seconds = rest_seconds + (own_draft or 0.0)
        if seconds > 0:  # the payoff guard's decayed sums at `rows` (tokens emitted, seconds spent)
            guard.add_round(rows, own_draft is not None, rows + sum(accepted or ()), seconds, probe=guard.probing)
        if guard.probing:  # a probe that turned the payoff comparison resets the wait, else it doubles
            guard.end_probe(rows)
        if survival is not None and survival.numel():
            matrix = survival.detach().double().cpu().reshape(-1, survival.shape[-1])
            mean = matrix.mean(dim=0)
            context.survival_estimate = blend_survival(context.survival_estimate, mean, self.smoothing)
            if verified is not None and accepted is not None and sum(verified):
                predicted = sum(float(matrix[r, :n].sum()) for r, n in enumerate(verified) if n)
                keep = 1 - self.smoothing
                context.predicted_accepted = keep * context.predicted_accepted + predicted
                context.realized_accepted = keep * context.realized_accepted + float(sum(accepted))
        tokens = forward_tokens + self.background_tokens + context.background_tokens
        plain = forward_tokens == rows
        context.since_plain[rows] = 0 if plain else context.since_plain.get(rows, 0) + 1
        if draft_seconds is not None:
            remember(context.draft_seconds, rows, draft_seconds, self.window)
        remember(context.round_seconds, (rows, tokens), rest_seconds, self.window)
        check_profile(self.sps, context, rows, tokens, rest_seconds)

    def _guard(self, context: ScheduleContext) -> PayoffGuard:
        if context.guard is None:
            context.guard = PayoffGuard(
                after=self.guard_after,
                margin=self.guard_margin,
                smoothing=self.guard_smoothing,
                plain_smoothing=self.plain_smoothing,
                probe_weight=self.probe_weight,
                explore=self.explore,
                explore_max=self.explore_max,
                scale_by_stake=self.scale_by_stake,
            )
        return context.guard


def resolve_policy(
    spec: VerificationPolicy | str | None, has_confidence: bool = True, calibrated: bool = False
) -> VerificationPolicy:
    """Turn a policy object or a string into a policy.

    Strings: `"fixed"`, `"fixed:4"`, `"adaptive"`, `"adaptive:4"` (fixed length with a payoff guard),
    `"threshold:0.3"` (survival rule), `"confidence_threshold:0.7"`
    (DeepSpec's rule), `"hardware_aware"`, `"hardware_aware:32"` (32
    background tokens), `"hardware_aware_lagged"`, `"hardware_aware_lagged:32"`, `"hardware_aware_uniform"`,
    `"hardware_aware_uniform:32"`.

    Args:
        spec: the policy, its string form, or `None` for the default: `hardware_aware_uniform` when the draft
            has a calibrated confidence head, otherwise `fixed` (the whole block). Both decide before drafting
            whether a round drafts at all, so the default never pays for a draft it then declines (Algorithm 1,
            `hardware_aware`, decides after drafting); measured in `benchmarks/bench_policies.py`.
        has_confidence (`bool`): whether the draft has a confidence head; all but `fixed` need one.
        calibrated (`bool`): whether the confidence head has been calibrated (STS).
    """
    if spec is None:
        return UniformHardwareAwarePolicy() if has_confidence and calibrated else FixedPolicy()
    if isinstance(spec, VerificationPolicy):
        policy = spec
    elif isinstance(spec, str):
        name, _, arg = spec.partition(":")
        try:
            if name == "fixed":
                policy = FixedPolicy(int(arg) if arg else None)
            elif name == "adaptive":
                policy = AdaptivePolicy(int(arg) if arg else 4)
            elif name == "threshold":
                policy = ThresholdPolicy(float(arg) if arg else 0.5)
            elif name == "confidence_threshold":
                policy = ConfidenceThresholdPolicy(float(arg) if arg else 0.5)
            elif name == "hardware_aware":
                policy = HardwareAwarePolicy(background_tokens=int(arg) if arg else 0)
            elif name == "hardware_aware_lagged":
                policy = LaggedHardwareAwarePolicy(background_tokens=int(arg) if arg else 0)
            elif name == "hardware_aware_uniform":
                policy = UniformHardwareAwarePolicy(background_tokens=int(arg) if arg else 0)
            else:
                raise KeyError(name)
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"Unknown verification policy {spec!r}: use 'fixed', 'fixed:N' (N tokens), 'adaptive[:N]' (N tokens "
                "while that pays, measured), 'threshold:T' "
                "(survival rule, 0 <= T <= 1), 'confidence_threshold:T' (DeepSpec's rule), 'hardware_aware[:BG]', 'hardware_aware_lagged[:BG]' or 'hardware_aware_uniform[:BG]' "
                "(BG = background tokens), "
                "or pass a VerificationPolicy object."
            ) from err
    else:
        raise TypeError(f"A verification policy must be a string or VerificationPolicy, got {type(spec).__name__}.")
    if policy.needs_confidence and not has_confidence:
        raise ValueError(
            f"Policy {policy!r} reads the draft's confidence head, but this draft has none "
            "(config.confidence_head=False). Use 'fixed' or a draft with a confidence head."
        )
    return policy
