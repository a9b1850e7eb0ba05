"""Confidence calibration with Sequential Temperature Scaling (STS), and calibration metrics.

The confidence head's raw outputs are overconfident (the paper reports ECE 3–8%). The scheduler multiplies
them into prefix survival probabilities `a_k = Π_{i≤k} σ(z_i / T_i)`, so errors compound along the block.
STS fits one temperature per position, left to right: for position `k` it grid-searches the `T_k` that
minimises the expected calibration error of `a_k` against the realised survival `y_k = 1[first k drafts
all accepted]`, with `T_1..T_{k-1}` already frozen. Temperature scaling never changes the ranking of
confidences at a position, only their scale.

Records come from real speculative decoding (`generate()` with the full block verified every round), so
`y_k` is observed for every position of every round. Metrics follow DeepSpec: ECE with 20 equal-width bins,
AUROC, and the Brier score, per position and pooled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..model.runs import last_generation_stats

DEFAULT_GRID = torch.logspace(math.log10(0.25), math.log10(8.0), 100, dtype=torch.float64)


@dataclass
class CalibrationRecords:
    """Per round: raw confidence logits, how many drafts were verified, how many were accepted.

    Args:
        logits (`torch.Tensor` of shape `(N, γ)`): raw confidence logits `z_k` (fp64).
        verified (`torch.LongTensor` of shape `(N,)`): drafted tokens sent to verification.
        accepted (`torch.LongTensor` of shape `(N,)`): how many of them were accepted.
    """

    logits: torch.Tensor
    verified: torch.Tensor
    accepted: torch.Tensor

    def __len__(self) -> int:
        return self.logits.shape[0]

    def observed(self, k: int) -> torch.Tensor:
        """Rows where position `k` (0-based) was verified, so its survival is known."""
        return self.verified > k

    def survived(self, k: int) -> torch.Tensor:
        """`y_k`: whether the first `k + 1` drafts were all accepted (float)."""
        return (self.accepted > k).double()

    def split(self, fraction: float = 0.5, seed: int = 0) -> tuple[CalibrationRecords, CalibrationRecords]:
        """Random split of the rounds (use prompt-level splits for strict held-out evaluation)."""
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        cut = int(len(self) * fraction)
        a, b = perm[:cut], perm[cut:]
        return self.select(a), self.select(b)

    def select(self, index: torch.Tensor) -> CalibrationRecords:
        return CalibrationRecords(self.logits[index], self.verified[index], self.accepted[index])

    @classmethod
    def concat(cls, parts: list[CalibrationRecords]) -> CalibrationRecords:
        return cls(
            torch.cat([p.logits for p in parts]),
            torch.cat([p.verified for p in parts]),
            torch.cat([p.accepted for p in parts]),
        )

    @classmethod
    def from_stats(cls, stats: Any) -> CalibrationRecords:
        """Rounds of a [`GenerationStats`] that drafted and scored tokens.

        The last round of a generation is dropped: it may have been cut by EOS or the length limit, which
        says nothing about whether its drafts would have survived.
        """
        rounds = [r for r in stats.rounds[:-1] if r.drafted and r.confidence_logits and r.verified > 0]
        gamma = stats.block_size
        logits = torch.zeros(len(rounds), gamma, dtype=torch.float64)
        for i, r in enumerate(rounds):
            logits[i, : len(r.confidence_logits)] = torch.tensor(r.confidence_logits, dtype=torch.float64)
        return cls(
            logits,
            torch.tensor([r.verified for r in rounds], dtype=torch.long),
            torch.tensor([r.accepted for r in rounds], dtype=torch.long),
        )


# ---------------------------------------------------------------------- metrics (pure functions)
def expected_calibration_error(pred: torch.Tensor, label: torch.Tensor, bins: int = 20) -> float:
    """ECE with `bins` equal-width bins: `Σ_b (n_b / N) · |mean(pred_b) − mean(label_b)|`."""
    if pred.numel() == 0:
        return float("nan")
    pred, label = pred.double(), label.double()
    index = torch.clamp((pred * bins).long(), max=bins - 1)
    total = 0.0
    for b in range(bins):
        mask = index == b
        if mask.any():
            total += mask.sum().item() * abs(pred[mask].mean().item() - label[mask].mean().item())
    return total / pred.numel()


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann–Whitney statistic, ties counted half); NaN with a single class."""
    label = label.bool()
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(score.double())
    ranks = torch.empty(score.numel(), dtype=torch.float64)
    sorted_scores = score.double()[order]
    # average ranks over ties
    i = 0
    n = score.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier_score(pred: torch.Tensor, label: torch.Tensor) -> float:
    """Mean squared error between predicted probability and outcome."""
    return float(((pred.double() - label.double()) ** 2).mean()) if pred.numel() else float("nan")


def survival_predictions(records: CalibrationRecords, temperatures: list[float] | torch.Tensor) -> torch.Tensor:
    """`a_k = Π_{i≤k} σ(z_i / T_i)` for every round and position, `(N, γ)`."""
    temps = torch.as_tensor(temperatures, dtype=torch.float64)
    return torch.cumprod(torch.sigmoid(records.logits / temps), dim=-1)


# ---------------------------------------------------------------------- fitting
def fit_sequential_temperatures(
    records: CalibrationRecords, grid: torch.Tensor = DEFAULT_GRID, bins: int = 20
) -> list[float]:
    """Sequential Temperature Scaling: one temperature per position, fitted left to right.

    Args:
        records ([`CalibrationRecords`]): rounds with confidence logits and realised survival.
        grid (`torch.Tensor`, *optional*): candidate temperatures (default: 100 log-spaced in [0.25, 8]).
        bins (`int`, *optional*, defaults to 20): ECE bins.

    Returns:
        `list[float]`: `T_1..T_γ` (1.0 where a position was never observed).
    """
    gamma = records.logits.shape[1]
    temps: list[float] = []
    prefix = torch.ones(len(records), dtype=torch.float64)  # Π_{i<k} σ(z_i / T_i) with frozen T_i
    for k in range(gamma):
        rows = records.observed(k)
        if not rows.any():
            temps.append(1.0)
            continue
        z, y, before = records.logits[rows, k], records.survived(k)[rows], prefix[rows]
        errors = [expected_calibration_error(before * torch.sigmoid(z / t), y, bins) for t in grid.tolist()]
        best = float(grid[min(range(len(errors)), key=errors.__getitem__)])
        temps.append(best)
        prefix = prefix * torch.sigmoid(records.logits[:, k] / best)
    return temps


def calibration_report(records: CalibrationRecords, temperatures: list[float], bins: int = 20) -> dict:
    """ECE, AUROC, Brier, count, mean prediction and mean outcome per position and pooled."""
    pred = survival_predictions(records, temperatures)
    per_position, all_pred, all_y = [], [], []
    for k in range(records.logits.shape[1]):
        rows = records.observed(k)
        p, y = pred[rows, k], records.survived(k)[rows]
        all_pred.append(p)
        all_y.append(y)
        per_position.append(_metrics(p, y, bins))
    overall = _metrics(torch.cat(all_pred), torch.cat(all_y), bins)
    return {"temperatures": list(temperatures), "per_position": per_position, "overall": overall}


def _metrics(pred: torch.Tensor, y: torch.Tensor, bins: int) -> dict:
    return {
        "n": int(pred.numel()),
        "ece": expected_calibration_error(pred, y, bins),
        "auroc": auroc(pred, y),
        "brier": brier_score(pred, y),
        "mean_predicted": float(pred.mean()) if pred.numel() else float("nan"),
        "mean_observed": float(y.mean()) if y.numel() else float("nan"),
    }


# ---------------------------------------------------------------------- end to end
def collect_records(
    target: Any,
    draft: Any,
    inputs: list[torch.Tensor],
    max_new_tokens: int = 128,
    do_sample: bool = True,
    temperature: float = 1.0,
    progress: bool = True,
    **generate_kwargs: Any,
) -> CalibrationRecords:
    """Run speculative decoding (whole block verified every round) and record confidences and survival.

    Args:
        target (`PreTrainedModel`): the target.
        draft ([`DSparkDraftModel`]): the draft (must have a confidence head).
        inputs (`list[torch.LongTensor]`): prompt token ids, one `(1, L)` tensor per prompt.
        max_new_tokens (`int`, *optional*, defaults to 128): per prompt.
        do_sample (`bool`, *optional*, defaults to `True`) / temperature (`float`): decoding mode; calibrate
            in the mode you will serve (the paper's protocol samples at temperature 1).
        progress (`bool`, *optional*, defaults to `True`): show a tqdm bar.
    """
    from tqdm.auto import tqdm

    if draft.confidence_head is None:
        raise ValueError("This draft has no confidence head (config.confidence_head=False): nothing to calibrate.")
    parts = []
    sampling = {"temperature": temperature, "top_k": None, "top_p": None} if do_sample else {}
    for ids in tqdm(inputs, desc="calibration rounds", disable=not progress):
        target.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            assistant_model=draft,
            dspark_policy="fixed",
            **sampling,
            **generate_kwargs,
        )
        parts.append(CalibrationRecords.from_stats(last_generation_stats(draft)))
    return CalibrationRecords.concat(parts)


def calibrate(
    draft: Any, fit: CalibrationRecords, held_out: CalibrationRecords | None = None, keep_worse: bool = False
) -> dict:
    """Fit STS temperatures on `fit`, store them in `draft.config`, and report before/after metrics.

    The temperatures travel with `save_pretrained` / `push_to_hub`; `config.confidence_calibrated` becomes
    `True`, which makes the hardware-aware policy the draft's default.

    A fit that makes the *held-out* ECE worse than the raw confidences (all temperatures 1.0) over-fitted the
    fit rounds: unless `keep_worse=True`, the draft then keeps temperatures of 1.0 (the raw head, which the
    held-out rounds showed the better calibrated), `report["temperatures"]` says so and
    `report["fitted_temperatures"]` holds the rejected fit. Without `held_out` the fit is always kept.

    Returns:
        `dict`: `{"temperatures", "fit": {"before", "after"}, "held_out": {"before", "after"}}`, plus
        `"fitted_temperatures"` and `"kept": "identity"` when the fit was rejected.
    """
    gamma = draft.config.block_size
    identity = [1.0] * gamma
    temps = fit_sequential_temperatures(fit)
    report = {
        "temperatures": temps,
        "fit": {
            "rounds": len(fit),
            "before": calibration_report(fit, identity),
            "after": calibration_report(fit, temps),
        },
    }
    if held_out is not None:
        report["held_out"] = {
            "rounds": len(held_out),
            "before": calibration_report(held_out, identity),
            "after": calibration_report(held_out, temps),
        }
        worse = report["held_out"]["after"]["overall"]["ece"] > report["held_out"]["before"]["overall"]["ece"]
        if worse and not keep_worse:
            report.update(fitted_temperatures=temps, kept="identity", temperatures=identity)
            temps = identity
    draft.config.calibration_temperatures = temps
    draft.config.confidence_calibrated = True
    return report


def json_safe(value: Any) -> Any:
    """Replace NaN/inf floats (e.g. AUROC with one class) by `None`, so reports are valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def reliability_diagram(records: CalibrationRecords, temperatures: list[float], path: str, bins: int = 10) -> str:
    """Save a reliability diagram (predicted vs observed prefix survival) before and after STS as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Reliability plots need matplotlib: pip install -e '.[eval]' in your dspark-hf clone"
        ) from err
    gamma = records.logits.shape[1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, (title, temps) in zip(axes, [("raw confidence", [1.0] * gamma), ("after STS", temperatures)]):
        pred = survival_predictions(records, temps)
        report = calibration_report(records, temps)
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
        for k in range(gamma):
            rows = records.observed(k)
            p, y = pred[rows, k], records.survived(k)[rows]
            if p.numel() == 0:
                continue
            idx = torch.clamp((p * bins).long(), max=bins - 1)
            xs, ys = [], []
            for b in range(bins):
                mask = idx == b
                if mask.sum() >= 5:
                    xs.append(float(p[mask].mean()))
                    ys.append(float(y[mask].mean()))
            ax.plot(xs, ys, marker="o", markersize=3, label=f"k={k + 1}")
        ax.set_title(f"{title}: ECE {100 * report['overall']['ece']:.1f}%")
        ax.set_xlabel("predicted prefix survival")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("observed prefix survival")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
