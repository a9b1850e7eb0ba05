"""Verification policies: how many of the drafted tokens to send to the target each round.

A policy sees, for each active request `r`, the survival probabilities `a[r, k] = Π_{i≤k} c[r, i]` of the
drafted block (`c` = calibrated confidences) and returns a length `ℓ_r ∈ {0..γ}`; the first `ℓ_r` drafted
tokens are verified.

**Why this stays lossless.** `c[r, k]` is computed from the backbone state and the *previous* drafted
token, never from token `k` itself. A policy that decides whether to verify position `k` from `a[r, ≤k]`
only (scanning left to right and stopping at the first "no") therefore never lets the value of a token
decide whether that same token is verified. Every policy here has this prefix property; a global search
that peeks past a "no" does not, and biases sampling (see the design notes, Appendix A counterexample).

Policies are small objects around pure tensor functions, so they can be table-tested and composed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .sps import SPSProfile


def survival_probabilities(confidences: torch.Tensor) -> torch.Tensor:
    """Prefix survival `a_k = Π_{i≤k} c_i` along the last dimension."""
    return torch.cumprod(confidences, dim=-1)


def fixed_lengths(survival: torch.Tensor, n: int) -> torch.Tensor:
    """Verify `min(n, γ)` tokens of every request. `survival`: `[R, γ]` → `[R]` (long)."""
    gamma = survival.shape[-1]
    return torch.full(survival.shape[:-1], min(max(n, 0), gamma), dtype=torch.long, device=survival.device)


def threshold_lengths(survival: torch.Tensor, threshold: float) -> torch.Tensor:
    """Survival rule: verify the longest prefix whose survival `a_k = Π c_i` stays `>= threshold`."""
    keep = (survival >= threshold).long()
    return torch.cumprod(keep, dim=-1).sum(dim=-1)


def confidence_threshold_lengths(survival: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSpec's rule: stop at the first position whose own confidence `c_k` is `< threshold`.

    The confidences are recovered from the survival probabilities as `c_k = a_k / a_{k-1}` (`a_0 = 1`),
    compared without dividing (`a_k >= t·a_{k-1}`). Once some `c_j < t` the prefix has stopped, so a zero
    survival after it never matters. `threshold <= 0` verifies the whole block, as in DeepSpec.
    """
    if threshold <= 0.0:
        return fixed_lengths(survival, survival.shape[-1])
    previous = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)
    keep = (survival >= threshold * previous).long()
    return torch.cumprod(keep, dim=-1).sum(dim=-1)


def hardware_aware_lengths(
    survival: torch.Tensor, sps: Callable[[int], float], background_tokens: int = 0
) -> torch.Tensor:
    """Paper Algorithm 1: greedy admission by survival probability with an early stop.

    All `(r, j)` with `a[r, j] > 0` are visited in decreasing order of `a` (ties in request-then-position
    order, so each request's prefix order holds). Admitting one adds a token to the forward
    (`B += 1`) and `a[r, j]` to the expected accepted tokens (`τ += a`); it is kept while the expected
    throughput `τ · SPS(B)` improves, and the search **stops at the first candidate that does not improve
    it**. Stopping there (instead of searching on) is what keeps sampling exact: the candidates visited
    before `(r, j)` never include anything computed from `x[r, j]`.

    Args:
        survival (`torch.Tensor` of shape `(R, γ)`): prefix survival probabilities (non-increasing in `j`).
        sps (`Callable[[int], float]`): verification steps per second at `B` tokens in the forward.
        background_tokens (`int`, *optional*, defaults to 0): tokens of other requests that share the forward.
            Each is modelled as a request decoding one token per step: it adds one token to `B` and one
            expected token to `τ`, so a loaded forward only admits drafts that pay for their share of it.

    Returns:
        `torch.LongTensor` of shape `(R,)`: verification length per request.
    """
    rows, gamma = survival.shape
    lengths = [0] * rows
    order, values = _candidate_order(survival)
    tokens = rows + background_tokens
    tau = float(rows + background_tokens)
    best = tau * sps(tokens)
    for idx, a in zip(order, values):
        if a <= 0:
            break
        r, j = divmod(idx, gamma)
        tokens += 1
        tau += a
        theta = tau * sps(tokens)
        if theta <= best:
            break  # early stop: never look past a candidate that does not pay for itself
        best = theta
        lengths[r] = j + 1
    return torch.tensor(lengths, dtype=torch.long, device=survival.device)


def best_capacity(survival: torch.Tensor, sps: Callable[[int], float], background_tokens: int = 0) -> int:
    """Unconstrained global search: the number `K` of top candidates maximising `τ · SPS(B)`.

    Used by the lagged policy on an *earlier* round's survival probabilities, where peeking at every
    candidate is harmless because none of them is decided now.
    """
    rows = survival.shape[0]
    _, values = _candidate_order(survival)
    values = [v for v in values if v > 0]
    base = rows + background_tokens
    tau, best, best_k = float(base), base * sps(base), 0
    for k, a in enumerate(values, start=1):
        tau += a
        theta = tau * sps(base + k)
        if theta > best:
            best, best_k = theta, k
    return best_k


def top_k_lengths(survival: torch.Tensor, capacity: int) -> torch.Tensor:
    """Admit the `capacity` candidates with the highest current survival (prefix order per request)."""
    rows, gamma = survival.shape
    lengths = [0] * rows
    order, values = _candidate_order(survival)
    for idx, a in list(zip(order, values))[: max(capacity, 0)]:
        if a <= 0:
            break
        r, j = divmod(idx, gamma)
        lengths[r] = j + 1
    return torch.tensor(lengths, dtype=torch.long, device=survival.device)


def uniform_length(
    survival: torch.Tensor,
    rows: int,
    sps: Callable[[int], float],
    draft_seconds: float = 0.0,
    background_tokens: int = 0,
    measured: dict[int, float] | None = None,
    min_length: int = 0,
) -> int:
    """The one verification length `L` for all `rows` requests that maximises expected tokens per second.

    A padded verification forward computes `B = rows · (1 + max ℓ)` tokens whatever each row's own length,
    so once one row verifies `L` drafts the others verify up to `L` for free; the choice is a single
    `L ∈ {0..γ}`. Drafting itself is charged only when `L > 0` (with `L = 0` the round is a plain decoding
    step and the draft does not run):

        Θ(L) = (rows·(1 + Σ_{j≤L} s_j) + BG) / (t(B_L) + draft·[L > 0]),   B_L = rows·(1 + L) + BG

    `t(B)` is the round time measured at `B` tokens where there is one (`measured`); otherwise the measured
    plain round `t(B_0)` scaled by the profile's cost ratio `SPS(B_0) / SPS(B)`, or, with no measurement
    at all, the profile's `1 / SPS(B)`. The profile thus gives the shape of the cost curve and the
    measurements its level (a round also builds the batch, accepts and emits).

    The search is global over `L`, which is lossless only because `survival` comes from *earlier* rounds:
    nothing in it depends on the tokens that will be drafted for the length chosen.

    Args:
        survival (`torch.Tensor` of shape `(γ,)`): expected prefix survival per block position.
        rows (`int`): requests in the round.
        sps (`Callable[[int], float]`): verification steps per second at `B` tokens in the forward.
        draft_seconds (`float`, *optional*): seconds of one drafting step for `rows` requests.
        background_tokens (`int`, *optional*): other requests' tokens sharing the forward, one each.
        measured (`dict[int, float]`, *optional*): seconds of a round besides drafting, measured at `B` tokens.
        min_length (`int`, *optional*, defaults to 0): the shortest length considered (`1`: the best length
            that drafts, for a probe).

    Returns:
        `int`: the length `L`.
    """
    if rows <= 0:
        return 0
    measured = measured or {}

    def rate(tokens: int) -> float:
        value = float(sps(tokens))
        if not value > 0:
            raise ValueError(f"The SPS profile gave {value} steps/s at {tokens} tokens; it must be positive.")
        return value

    plain_tokens = rows + background_tokens
    expected = torch.cat([torch.zeros(1, dtype=torch.float64), survival.detach().double().cpu().cumsum(0)])
    best_length, best = 0, -1.0
    for length, gained in enumerate(expected.tolist()):
        if length < min_length:
            continue
        tokens = rows * (1 + length) + background_tokens
        if tokens in measured:
            cost = measured[tokens]
        elif plain_tokens in measured:
            cost = measured[plain_tokens] * rate(plain_tokens) / rate(tokens)
        else:
            cost = 1.0 / rate(tokens)
        cost += draft_seconds if length else 0.0
        theta = (rows * (1.0 + gained) + background_tokens) / max(cost, 1e-12)
        if theta > best:
            best, best_length = theta, length
    return best_length


def _candidate_order(survival: torch.Tensor) -> tuple[list[int], list[float]]:
    """Flat indices `r·γ + j` sorted by decreasing survival; ties keep request-then-position order."""
    flat = survival.detach().reshape(-1).double().cpu()
    values, order = torch.sort(flat, descending=True, stable=True)
    return order.tolist(), values.tolist()


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
        since_draft (`dict[int, int]`): rounds since the last drafting round, per number of requests.
        probe_wait (`dict[int, int]`): plain rounds [`UniformHardwareAwarePolicy`] waits before its next probe,
            per number of requests; `probing` whether the planned round is such a probe.
        payoff (`dict[int, PayoffState]`): measured rates of drafting and plain rounds per number of requests
            ([`AdaptivePolicy`]'s, and [`UniformHardwareAwarePolicy`]'s payoff guard).
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
    since_draft: dict[int, int] = field(default_factory=dict)
    probe_wait: dict[int, int] = field(default_factory=dict)
    probing: bool = False
    payoff: dict[int, PayoffState] = field(default_factory=dict)


@dataclass
class PayoffState:
    """What [`AdaptivePolicy`] has measured at one batch size: tokens emitted and seconds spent by drafting rounds
    and by plain rounds (decayed sums, so the rates are recent), how many of each it has seen, and where it
    stands in its back-off."""

    draft_tokens: float = 0.0
    draft_seconds: float = 0.0
    plain_tokens: float = 0.0
    plain_seconds: float = 0.0
    drafts: int = 0
    plains: int = 0
    streak: int = 0  # drafting rounds since the last plain round
    idle: int = 0  # plain rounds since drafting last lost (or was last probed)
    interval: int = 0  # plain rounds to wait before the next probe

    def add(self, drafted: bool, tokens: float, seconds: float, keep: float) -> None:
        """Add a round (`tokens` emitted in `seconds`) to the drafting or the plain sums, the old sums kept at
        weight `keep`."""
        if drafted:
            self.draft_tokens = keep * self.draft_tokens + tokens
            self.draft_seconds = keep * self.draft_seconds + seconds
            self.drafts += 1
        else:
            self.plain_tokens = keep * self.plain_tokens + tokens
            self.plain_seconds = keep * self.plain_seconds + seconds
            self.plains += 1

    @property
    def draft_rate(self) -> float:
        return self.draft_tokens / self.draft_seconds if self.draft_seconds > 0 else 0.0

    @property
    def plain_rate(self) -> float:
        return self.plain_tokens / self.plain_seconds if self.plain_seconds > 0 else 0.0


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

    A payoff guard for a fixed length: it compares what drafting really earns here (tokens emitted over the
    whole round's time, drafting included) with plain decoding's measured rate, so on text the draft
    predicts poorly, or on a machine where verification is dear, it falls back to plain decoding instead of
    paying for drafts that are not accepted. It starts by drafting `warmup_drafts` rounds (a reply's first
    rounds are often its most predictable: the opening of a chat answer, the start of a code block), then
    measures `plain_samples` plain rounds, then takes the faster arm each round. While plain wins it probes
    one drafting round after `explore` plain rounds, doubling the wait up to `explore_max` for every probe
    that does not turn the verdict, and resetting it when drafting wins again; while drafting wins, one plain
    round in every `refresh_every` re-measures the alternative (the machine's load drifts). Each rate is
    tokens over seconds of recent rounds (sums that decay by `1 - smoothing` per drafting round and
    `1 - plain_smoothing` per plain round: a ratio of sums, not a mean of noisy per-round ratios); a probe
    decays the drafting sums by `1 - probe_weight` instead, so one good probe can resume drafting.

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

    def _state(self, context: ScheduleContext, rows: int) -> PayoffState:
        if rows not in context.payoff:
            context.payoff[rows] = PayoffState(interval=self.explore)
        return context.payoff[rows]

    def _probing(self, state: PayoffState) -> bool:
        return state.drafts >= self.warmup_drafts and state.draft_rate <= state.plain_rate

    def plan_length(self, rows: int, gamma: int, context: ScheduleContext) -> int:
        state = self._state(context, rows)
        length = gamma if self.n is None else min(self.n, gamma)
        if state.drafts < self.warmup_drafts:
            return length
        if state.plains < self.plain_samples:
            return 0
        if state.draft_rate > state.plain_rate:  # drafting pays here
            return 0 if state.streak >= self.refresh_every else length
        return length if state.idle >= state.interval else 0  # a probe, or plain decoding

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
        state = self._state(context, rows)
        seconds = rest_seconds + (draft_seconds or 0.0)
        if seconds <= 0:
            return
        tokens = rows + sum(accepted or ())  # every round emits one target token per row
        if draft_seconds is not None and verified and sum(verified) > 0:
            probe = self._probing(state) and state.idle >= state.interval
            keep = 1 - (self.probe_weight if probe else self.smoothing)
            state.add(True, tokens, seconds, keep)
            state.streak += 1
            if probe:  # the verdict stands: wait twice as long; it turned: back to the shortest wait
                state.idle = 0
                lost = state.draft_rate <= state.plain_rate
                state.interval = min(2 * state.interval, self.explore_max) if lost else self.explore
        else:
            sample = state.plains < self.plain_samples  # a measuring round, not one the verdict chose
            keep = 1 - self.plain_smoothing
            state.add(False, tokens, seconds, keep)
            state.streak = 0
            if not sample and self._probing(state):
                state.idle += 1


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
        sps = _sps_fn(self.sps, context)
        return hardware_aware_lengths(survival, sps, self.background_tokens + context.background_tokens)

    def observe_round(self, context, rows, forward_tokens, rest_seconds, **kwargs) -> None:
        _check_profile(self.sps, context, rows, forward_tokens + self.background_tokens, rest_seconds)


def _check_profile(profile, context: ScheduleContext, rows: int, tokens: int, seconds: float) -> None:
    """Report a single-request round's time to its SPS profile, which flags itself when they disagree."""
    if profile is None:  # the profile generate() / the engine put in the context, if that is one
        profile = getattr(context.sps, "__self__", None)
    if rows == 1 and isinstance(profile, SPSProfile):
        profile.observe(tokens, seconds)


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
        sps = _sps_fn(self.sps, context)
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

    **Probes.** Survival and costs are only measured by drafting rounds, so a verdict "no length pays" would
    stand for good on the strength of whatever the last drafting rounds measured, and the first drafting
    round at a batch size is often a cold one (new forward shapes, a prompt's opening tokens). So after
    `explore` plain rounds at a batch size in which no length paid, the policy drafts one round at the best
    length that drafts (a probe). A probe after which drafting rounds at that size still measure fewer tokens
    per second than plain ones (the payoff sums below, the probe weighted `probe_weight`) doubles the wait
    before the next one, up to `explore_max`; one that turns that comparison resets it to `explore`. Its survival, timings and accepted drafts feed the estimates like any drafting round's.
    Once the verdict is settled, at most one round in `explore_max` is spent on a losing draft.

    **Payoff guard.** The plan is a model (survival times measured or profiled costs), and at a batch size where
    drafting is marginal a small error in it decides. So the policy also keeps what drafting rounds and plain
    rounds really emitted per second at each batch size (decayed sums, as [`AdaptivePolicy`] does): once
    `guard_after` drafting rounds at a size have not emitted `guard_margin` (10%) more tokens per second than
    its plain rounds, the planned length there is 0 until a probe's measurement (weighted `probe_weight`) turns
    the comparison. That verdict also stands for every larger batch size that has not measured a gain of its
    own (`inherit_veto`).

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
        guard_margin (`float`, *optional*, defaults to 0.1): drafting rounds must emit this much more per second
            than plain rounds to count as a gain (for the guard, the probes' verdict and `inherit_veto`). Round
            times scatter by ±10% on a shared host, and a verdict that flips on noise drafts in runs of
            losing rounds until it flips back; a gain smaller than the margin is forgone.
        probe_weight (`float`, *optional*, defaults to 0.5): decay of the guard's drafting sums at a probe, so
            that one probe that pays can turn the comparison.
        inherit_veto (`bool`, *optional*, defaults to `True`): a guard's verdict against drafting at a batch size
            stands for every larger one (no plan, no probe there) unless that size's own drafting rounds measured
            a gain. A server's batch size changes with every arrival and departure, and without this each size
            pays its own warm-up drafts and probes; with it, the small sizes (which a server passes through as
            traffic drains) settle the question for the large ones. It rests on a verified draft token costing
            at least as much in a larger batch as in a smaller one (the forward's extra tokens are nearly free
            while it is bound by reading the weights, at small batches, and cost their share of compute once
            it is not) while a row's expected gain does not depend on the batch.
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
    name = "hardware_aware_uniform"

    def plan_length(self, rows: int, gamma: int, context: ScheduleContext) -> int:
        sps = _sps_fn(self.sps, context)
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
            draft_seconds=_nearest(context.draft_seconds, rows),
            background_tokens=self.background_tokens + context.background_tokens,
            measured=measured,
        )
        length = uniform_length(estimate, rows, sps, **kwargs)
        guard = context.payoff.get(rows)
        if length and self._settled(guard) and not self._pays(guard):
            length = 0  # drafting rounds here did not really emit more per second (by the margin)
        if self.inherit_veto and self._vetoed_below(context, rows):
            return 0  # drafting measured a loss at a smaller batch size: no plan and no probe here either
        wait = context.probe_wait.get(rows, self.explore)
        if length == 0 and self.explore and gamma > 0 and context.since_draft.get(rows, 0) >= wait:
            context.probing = True  # `observe_round` weighs the probe and sets the next wait
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
        context.since_draft[rows] = 0 if draft_seconds is not None else context.since_draft.get(rows, 0) + 1
        self._measure_payoff(context, rows, rest_seconds, draft_seconds if drafted else None, accepted)
        if context.probing:  # a probe that turned the payoff comparison resets the wait, else it doubles
            context.probing = False
            state = context.payoff.get(rows)
            paid = state is not None and self._pays(state)
            wait = context.probe_wait.get(rows, self.explore)
            context.probe_wait[rows] = self.explore if paid else min(2 * wait, self.explore_max)
        if survival is not None and survival.numel():
            matrix = survival.detach().double().cpu().reshape(-1, survival.shape[-1])
            mean = matrix.mean(dim=0)
            context.survival_estimate = _blend(context.survival_estimate, mean, self.smoothing)
            if verified is not None and accepted is not None and sum(verified):
                predicted = sum(float(matrix[r, :n].sum()) for r, n in enumerate(verified) if n)
                keep = 1 - self.smoothing
                context.predicted_accepted = keep * context.predicted_accepted + predicted
                context.realized_accepted = keep * context.realized_accepted + float(sum(accepted))
        tokens = forward_tokens + self.background_tokens + context.background_tokens
        plain = forward_tokens == rows
        context.since_plain[rows] = 0 if plain else context.since_plain.get(rows, 0) + 1
        if draft_seconds is not None:
            _remember(context.draft_seconds, rows, draft_seconds, self.window)
        _remember(context.round_seconds, (rows, tokens), rest_seconds, self.window)
        _check_profile(self.sps, context, rows, tokens, rest_seconds)

    def _settled(self, state: PayoffState | None) -> bool:
        """Whether the payoff guard has measured enough drafting rounds in `state` to judge."""
        return bool(self.guard_after) and state is not None and state.drafts >= self.guard_after

    def _pays(self, state: PayoffState) -> bool:
        """Whether drafting rounds in `state` emitted more per second than plain ones, by the margin."""
        return state.draft_rate > (1 + self.guard_margin) * state.plain_rate

    def _vetoed_below(self, context, rows: int) -> bool:
        """Whether drafting measured a loss at some batch size smaller than `rows` while `rows` has no drafting
        rounds of its own that measured a gain."""
        own = context.payoff.get(rows)
        if self._settled(own) and self._pays(own):
            return False
        return any(r < rows and self._settled(s) and not self._pays(s) for r, s in context.payoff.items())

    def _measure_payoff(self, context, rows, rest_seconds, draft_seconds, accepted) -> None:
        """Add a round to the payoff guard's decayed sums at `rows` (tokens emitted, seconds spent)."""
        seconds = rest_seconds + (draft_seconds or 0.0)
        if seconds <= 0:
            return
        drafted = draft_seconds is not None
        if drafted:
            keep = 1 - (self.probe_weight if context.probing else self.guard_smoothing)
        else:
            keep = 1 - self.plain_smoothing
        context.payoff.setdefault(rows, PayoffState()).add(drafted, rows + sum(accepted or ()), seconds, keep)


def _blend(old: torch.Tensor | None, mean: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The running mean survival per position after a round whose mean is `mean`. A round may have drafted
    fewer positions than earlier ones (only those its planned length could verify): the positions it did not
    draft keep their estimate, and positions drafted for the first time start at the round's mean."""
    if old is None:
        return mean
    n = min(old.numel(), mean.numel())
    out = (old if old.numel() >= mean.numel() else mean).clone()
    out[:n] = (1 - smoothing) * old[:n] + smoothing * mean[:n]
    return out


def _remember(table: dict, key, value: float, window: int) -> None:
    """Append `value` to `table[key]`, keeping the last `window` values."""
    values = table.setdefault(key, [])
    values.append(float(value))
    del values[:-window]


def _nearest(table: dict[int, list[float]], rows: int) -> float:
    """Median of the values measured at `rows`, else at the nearest measured size (the larger on a tie), else 0."""
    if not table:
        return 0.0
    key = rows if rows in table else min(table, key=lambda r: (abs(r - rows), -r))
    return statistics.median(table[key])


def _sps_fn(profile: SPSProfile | None, context: ScheduleContext) -> Callable[[int], float]:
    if profile is not None:
        return profile.sps
    if context.sps is None:
        raise ValueError(
            "The hardware-aware policy needs the target's SPS profile: pass HardwareAwarePolicy(sps=...) or let "
            "generate() / the engine provide it (dspark_hf.scheduling.sps.get_sps_profile(target))."
        )
    return context.sps


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
