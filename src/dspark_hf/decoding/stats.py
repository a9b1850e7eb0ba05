"""Per-round statistics of speculative generation, and their summaries (τ, acceptance per position, timing).

`generate(assistant_model=draft)` fills a fresh [`GenerationStats`] and leaves it on
`dspark_hf.last_generation_stats(draft)`; it is updated while generation runs, so a streamer can read it live.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RoundStats:
    """One speculative round.

    Args:
        drafted (`list[int]`): all γ tokens the draft sampled (only the first `verified` went to the target).
        confidence_logits (`list[float]`): raw confidence-head logits `z_k` (what calibration fits).
        confidence (`list[float]`): raw confidence `σ(z_k)` per drafted position (empty without a head).
        calibrated_confidence (`list[float]`): `σ(z_k / T_k)` after temperature scaling.
        survival (`list[float]`): prefix survival `Π_{i≤k}` of the calibrated confidences.
        verified (`int`): how many drafted tokens the policy sent to verification.
        accepted (`int`): how many of those the target accepted (the round also emits one target token).
        draft_time (`float`): seconds in the backbone (context update + block forward + base logits).
        sequential_time (`float`): seconds in the left-to-right sampling loop (sequential + confidence heads).
        verify_time (`float`): seconds from handing candidates to the target until the acceptance was known.
        source (`str`): who proposed the verified tokens: `"draft"` (the draft, or nobody in a plain round) or
            `"lookup"` (copied from the context by prompt lookup, see `dspark_hf.decoding.lookup`; `drafted`
            then holds the copied tokens and the confidence fields are empty).
    """

    drafted: list[int]
    confidence_logits: list[float]
    confidence: list[float]
    calibrated_confidence: list[float]
    survival: list[float]
    verified: int
    accepted: int = 0
    draft_time: float = 0.0
    sequential_time: float = 0.0
    verify_time: float = 0.0
    source: str = "draft"

    @property
    def predicted_accepted(self) -> float:
        """Expected accepted count under the calibrated survival estimates: `Σ_{k≤verified} a_k`."""
        return float(sum(self.survival[: self.verified]))


@dataclass
class GenerationStats:
    """All rounds of one `generate()` call (prefill excluded) and their summaries.

    `cuda_graphs` says whether the draft step ran as a captured CUDA graph in this call
    (`dspark_hf.decoding.draft_graphs`); `cuda_graphs_fallback` is the reason it did not, when the option was on.
    """

    block_size: int
    policy: str
    rounds: list[RoundStats] = field(default_factory=list)
    cuda_graphs: bool = False
    cuda_graphs_fallback: str | None = None

    @property
    def num_rounds(self) -> int:
        """`int`: target verification passes after the prefill."""
        return len(self.rounds)

    @property
    def tau(self) -> float:
        """`float`: mean tokens per round, accepted drafts + the target's own token, micro-averaged."""
        if not self.rounds:
            return 0.0
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)

    @property
    def acceptance_by_position(self) -> list[float]:
        """`list[float]`: prefix survival P(first k drafts accepted | k were verified), k = 1..γ (NaN if never),
        over the rounds the draft proposed (lookup rounds are the copy's, not the draft's)."""
        rates = []
        for k in range(self.block_size):
            verified = [r for r in self.rounds if r.verified > k and r.source == "draft"]
            rates.append(sum(r.accepted > k for r in verified) / len(verified) if verified else float("nan"))
        return rates

    @property
    def lookup_rounds(self) -> int:
        """`int`: rounds whose verified tokens prompt lookup copied from the context."""
        return sum(r.source == "lookup" for r in self.rounds)

    @property
    def mean_verified(self) -> float:
        """`float`: mean number of drafted tokens sent to verification per round."""
        return sum(r.verified for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def mean_predicted_accepted(self) -> float:
        """`float`: mean accepted drafts per round predicted by the calibrated survival (scheduler's view)."""
        return sum(r.predicted_accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        """`float`: mean accepted drafts per round actually realised."""
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def time_split(self) -> dict[str, float]:
        """Total seconds spent in the draft backbone, the sequential loop and target verification."""
        return {
            "draft_backbone": sum(r.draft_time for r in self.rounds),
            "sequential_loop": sum(r.sequential_time for r in self.rounds),
            "target_verification": sum(r.verify_time for r in self.rounds),
        }

    def summary(self) -> dict:
        """A JSON-ready summary: τ, rounds, mean verified length, acceptance per position, time split."""
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "rounds": self.num_rounds,
            "tau": self.tau,
            "mean_verified": self.mean_verified,
            "mean_accepted": self.mean_accepted,
            "mean_predicted_accepted": self.mean_predicted_accepted,
            "acceptance_by_position": self.acceptance_by_position,
            "lookup_rounds": self.lookup_rounds,
            "time_split": self.time_split(),
            "cuda_graphs": self.cuda_graphs,
        }

    def to_dict(self) -> dict:
        """Summary plus every round, JSON-ready."""
        return {**self.summary(), "per_round": [asdict(r) for r in self.rounds]}
