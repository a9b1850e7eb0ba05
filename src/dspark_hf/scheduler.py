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

from collections.abc import Callable
from dataclasses import dataclass

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
    """Verify the longest prefix whose survival stays `>= threshold` (stopping at the first miss)."""
    keep = (survival >= threshold).long()
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
    """

    sps: Callable[[int], float] | None = None
    background_tokens: int = 0
    previous_survival: torch.Tensor | None = None


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


@dataclass
class FixedPolicy(VerificationPolicy):
    """Verify `n` drafted tokens every round (`n=None`: the whole block)."""

    n: int | None = None
    name = "fixed"
    needs_confidence = False

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return fixed_lengths(survival, survival.shape[-1] if self.n is None else self.n)


@dataclass
class ThresholdPolicy(VerificationPolicy):
    """Verify while the running product of calibrated confidences stays `>= threshold` (DeepSpec's rule)."""

    threshold: float = 0.5
    name = "threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}.")

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        return threshold_lengths(survival, self.threshold)


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


def _sps_fn(profile: SPSProfile | None, context: ScheduleContext) -> Callable[[int], float]:
    if profile is not None:
        return profile.sps
    if context.sps is None:
        raise ValueError(
            "The hardware-aware policy needs the target's SPS profile: pass HardwareAwarePolicy(sps=...) or let "
            "generate() / the engine provide it (dspark_hf.sps.get_sps_profile(target))."
        )
    return context.sps


def resolve_policy(
    spec: VerificationPolicy | str | None, has_confidence: bool = True, calibrated: bool = False
) -> VerificationPolicy:
    """Turn a policy object or a string into a policy.

    Strings: `"fixed"`, `"fixed:4"`, `"threshold:0.3"`, `"hardware_aware"`, `"hardware_aware:32"` (32
    background tokens), `"hardware_aware_lagged"`, `"hardware_aware_lagged:32"`.

    Args:
        spec: the policy, its string form, or `None` for the default: `hardware_aware` when the draft has a
            calibrated confidence head, otherwise `fixed` (the whole block).
        has_confidence (`bool`): whether the draft has a confidence head; all but `fixed` need one.
        calibrated (`bool`): whether the confidence head has been calibrated (STS).
    """
    if spec is None:
        return HardwareAwarePolicy() if has_confidence and calibrated else FixedPolicy()
    if isinstance(spec, VerificationPolicy):
        policy = spec
    elif isinstance(spec, str):
        name, _, arg = spec.partition(":")
        try:
            if name == "fixed":
                policy = FixedPolicy(int(arg) if arg else None)
            elif name == "threshold":
                policy = ThresholdPolicy(float(arg) if arg else 0.5)
            elif name == "hardware_aware":
                policy = HardwareAwarePolicy(background_tokens=int(arg) if arg else 0)
            elif name == "hardware_aware_lagged":
                policy = LaggedHardwareAwarePolicy(background_tokens=int(arg) if arg else 0)
            else:
                raise KeyError(name)
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"Unknown verification policy {spec!r}: use 'fixed', 'fixed:N' (N tokens), 'threshold:T' "
                "(0 <= T <= 1), 'hardware_aware[:BG]' or 'hardware_aware_lagged[:BG]' (BG = background tokens), "
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
