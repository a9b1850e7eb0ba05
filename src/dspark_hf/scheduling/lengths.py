"""Verification lengths as pure functions on tensors: the math every policy in `dspark_hf.scheduling.policies`
is a small object around, table-tested in `tests/test_scheduler*.py`.

`survival[r, k]` is the predicted chance that request `r`'s drafted token `k` is accepted (the running product
of calibrated confidences); each function returns, per request, how many drafted tokens to verify.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

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


# ---------------------------------------------------------------------- helpers of the measuring policies
def blend_survival(old: torch.Tensor | None, mean: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The running mean survival per position after a round whose mean is `mean`. A round may have drafted
    fewer positions than earlier ones (only those its planned length could verify): the positions it did not
    draft keep their estimate, and positions drafted for the first time start at the round's mean."""
    if old is None:
        return mean
    n = min(old.numel(), mean.numel())
    out = (old if old.numel() >= mean.numel() else mean).clone()
    out[:n] = (1 - smoothing) * old[:n] + smoothing * mean[:n]
    return out


def remember(table: dict, key, value: float, window: int) -> None:
    """Append `value` to `table[key]`, keeping the last `window` values."""
    values = table.setdefault(key, [])
    values.append(float(value))
    del values[:-window]


def nearest(table: dict[int, list[float]], rows: int) -> float:
    """Median of the values measured at `rows`, else at the nearest measured size (the larger on a tie), else 0."""
    if not table:
        return 0.0
    key = rows if rows in table else min(table, key=lambda r: (abs(r - rows), -r))
    return statistics.median(table[key])


def sps_function(profile: SPSProfile | None, context) -> Callable[[int], float]:
    if profile is not None:
        return profile.sps
    if context.sps is None:
        raise ValueError(
            "The hardware-aware policy needs the target's SPS profile: pass HardwareAwarePolicy(sps=...) or let "
            "generate() / the engine provide it (dspark_hf.scheduling.sps.get_sps_profile(target))."
        )
    return context.sps


def check_profile(profile, context, rows: int, tokens: int, seconds: float) -> None:
    """Report a single-request round's time to its SPS profile, which flags itself when they disagree."""
    if profile is None:  # the profile generate() / the engine put in the context, if that is one
        profile = getattr(context.sps, "__self__", None)
    if rows == 1 and isinstance(profile, SPSProfile):
        profile.observe(tokens, seconds)
