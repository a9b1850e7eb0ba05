"""The statistics of an evaluation, as plain functions: acceptance by draft position from `(verified, accepted)`
pairs, and whether two per-prompt correctness lists differ by more than sampling noise.

Nothing here imports torch; every function works on numbers and lists, so it is table-tested by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def rounds_of(stats) -> list[tuple[int, int]]:
    """`(verified, accepted)` per round of a [`GenerationStats`] (all that the acceptance curves need). A round
    whose tokens prompt lookup copied counts as verifying no drafted token, so the acceptance curves are the
    draft's alone while τ (accepted + 1 per round) counts every token."""
    return [(r.verified if getattr(r, "source", "draft") == "draft" else 0, r.accepted) for r in stats.rounds]


def ratio(num: int, den: int) -> float:
    """`num / den`, NaN for an empty denominator (a position no round reached)."""
    return num / den if den else float("nan")


def acceptance_curves(rounds: Iterable[tuple[int, int]], block_size: int) -> dict:
    """Acceptance by draft position k = 1..`block_size` over rounds of any number of prompts.

    Args:
        rounds (`Iterable[tuple[int, int]]`): `(verified, accepted)` per round (see [`rounds_of`]).
        block_size (`int`): γ, the number of positions reported.

    Returns:
        `dict` with lists indexed by k − 1:
            - `prefix_survival`: P(drafts 1..k all accepted | at least k verified), the design's `accept@k`;
            - `conditional_acceptance`: P(draft k accepted | drafts 1..k−1 accepted, at least k verified),
              the paper's Figure 2 (survival k / survival k − 1 when every round verifies the whole block);
            - `reached`: rounds counted in `conditional_acceptance` at k (its denominator);
            - `verified_at`: rounds that verified at least k drafts;
        and the scalars `rounds`, `tau` (mean accepted + 1 per round), `mean_verified`, `mean_accepted` and
        `verify_rate` (verified / drafted tokens). Positions with no rounds are NaN.
    """
    rounds = list(rounds)
    out = {"prefix_survival": [], "conditional_acceptance": [], "reached": [], "verified_at": []}
    for k in range(1, block_size + 1):
        verified = [a for v, a in rounds if v >= k]
        reached = [a for a in verified if a >= k - 1]
        out["prefix_survival"].append(ratio(sum(a >= k for a in verified), len(verified)))
        out["conditional_acceptance"].append(ratio(sum(a >= k for a in reached), len(reached)))
        out["reached"].append(len(reached))
        out["verified_at"].append(len(verified))
    n = len(rounds)
    out["rounds"] = n
    out["tau"] = ratio(sum(a + 1 for _, a in rounds), n)
    out["mean_verified"] = ratio(sum(v for v, _ in rounds), n)
    out["mean_accepted"] = ratio(sum(a for _, a in rounds), n)
    out["verify_rate"] = ratio(sum(v for v, _ in rounds), n * block_size)
    return out


def paired_accuracy_test(plain: Sequence[bool], other: Sequence[bool], alpha: float = 0.05) -> dict:
    """Are two per-prompt correctness lists (same prompts, independent samples) within sampling noise?

    McNemar's exact test: if both methods sample from the same distribution, a prompt solved by exactly one
    of them is equally likely to be solved by either, so the discordant counts `b` (plain only) and `c`
    (other only) follow Binomial(b + c, 1/2). Also reported: the unpaired two-proportion z-test.

    Returns:
        `dict`: both accuracies, their difference, `discordant` `[b, c]`, `mcnemar_exact_p`, `z_test_p`, and
        `within_noise` (`mcnemar_exact_p >= alpha`).
    """
    if len(plain) != len(other):
        raise ValueError(f"Correctness lists differ in length ({len(plain)} vs {len(other)}); pair them by prompt.")
    n = len(plain)
    b = sum(p and not o for p, o in zip(plain, other))
    c = sum(o and not p for p, o in zip(plain, other))
    m = b + c
    p_mcnemar = min(1.0, 2 * sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2**m) if m else 1.0
    p1, p2 = ratio(sum(map(bool, plain)), n), ratio(sum(map(bool, other)), n)
    pooled = (p1 + p2) / 2 if n else float("nan")
    se = math.sqrt(pooled * (1 - pooled) * 2 / n) if n else 0.0
    p_z = math.erfc(abs(p2 - p1) / se / math.sqrt(2)) if se > 0 else 1.0
    return {
        "plain_accuracy": p1,
        "accuracy": p2,
        "difference": p2 - p1 if n else float("nan"),
        "discordant": [b, c],
        "mcnemar_exact_p": p_mcnemar,
        "z_test_p": p_z,
        "within_noise": p_mcnemar >= alpha,
    }


def nanmean(values: Iterable[float]) -> float:
    """The mean of the finite values (NaN when there is none): sets with no rounds at a position do not count."""
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def temperature_key(temperature: float) -> str:
    """How a temperature is written as a key of the summaries: `0`, `1`, `0.7`."""
    return f"{temperature:g}"
