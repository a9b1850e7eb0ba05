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

from dataclasses import dataclass

import torch


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


class VerificationPolicy:
    """Base class: subclasses implement `choose_lengths(survival) -> lengths`.

    `needs_confidence` tells the drafter whether the confidence head must run (a fixed policy does not).
    """

    name = "policy"
    needs_confidence = True

    def choose_lengths(self, survival: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class FixedPolicy(VerificationPolicy):
    """Verify `n` drafted tokens every round (`n=None`: the whole block)."""

    n: int | None = None
    name = "fixed"
    needs_confidence = False

    def choose_lengths(self, survival: torch.Tensor) -> torch.Tensor:
        return fixed_lengths(survival, survival.shape[-1] if self.n is None else self.n)


@dataclass
class ThresholdPolicy(VerificationPolicy):
    """Verify while the running product of calibrated confidences stays `>= threshold` (DeepSpec's rule)."""

    threshold: float = 0.5
    name = "threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}.")

    def choose_lengths(self, survival: torch.Tensor) -> torch.Tensor:
        return threshold_lengths(survival, self.threshold)


def resolve_policy(spec: VerificationPolicy | str | None, has_confidence: bool = True) -> VerificationPolicy:
    """Turn a policy object or a string (`"fixed"`, `"fixed:4"`, `"threshold:0.3"`) into a policy.

    Args:
        spec: the policy, its string form, or `None` for the default (`fixed`, the whole block).
        has_confidence (`bool`): whether the draft has a confidence head; threshold policies need one.
    """
    if spec is None:
        return FixedPolicy()
    if isinstance(spec, VerificationPolicy):
        policy = spec
    elif isinstance(spec, str):
        name, _, arg = spec.partition(":")
        try:
            if name == "fixed":
                policy = FixedPolicy(int(arg) if arg else None)
            elif name == "threshold":
                policy = ThresholdPolicy(float(arg) if arg else 0.5)
            else:
                raise KeyError(name)
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"Unknown verification policy {spec!r}: use 'fixed', 'fixed:N' (N tokens), or 'threshold:T' "
                "(0 <= T <= 1), or pass a VerificationPolicy object."
            ) from err
    else:
        raise TypeError(f"A verification policy must be a string or VerificationPolicy, got {type(spec).__name__}.")
    if policy.needs_confidence and not has_confidence:
        raise ValueError(
            f"Policy {policy!r} reads the draft's confidence head, but this draft has none "
            "(config.confidence_head=False). Use 'fixed' or a draft with a confidence head."
        )
    return policy
