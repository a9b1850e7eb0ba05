"""Evaluate drafts against their target on named prompt sets (the paper's protocol, `docs/evaluation.md`).

[`evaluate_drafts`] runs plain `generate()`, speculative `generate(assistant_model=draft)` for every draft and,
at temperature 0, transformers' prompt lookup decoding, interleaved prompt by prompt, and returns an
[`EvalReport`]: τ, acceptance per position (prefix survival and the paper's conditional acceptance), verified
length, tokens/s and speedups measured in the same run, and the quality-parity checks (greedy identity,
GSM8K accuracy, HumanEval pass@1) computed with the `evaluate` metric scripts of [`dspark_hf.evaluation.eval_metrics`].
`dspark eval` is the command line for it.

Only the standard library and the package's light modules are imported here; torch, tqdm, `evaluate` and
matplotlib are imported by the functions that use them.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..scheduling.calibration import json_safe
from .eval_metrics import load_metric, token_string
from .prompt_sets import EVAL_SETS, PromptItem, load_prompt_set

#: Plain `generate()` on the stock kernels: what a user of plain `generate()` gets; `speedup` is over it.
PLAIN = "plain"
PROMPT_LOOKUP = "prompt_lookup"
#: Plain `generate()` with the target's linears on packed CPU weights (`dspark_hf.model.cpu_packing`); with
#: `kernels="packed"` it is the same-kernels baseline, and `speedup_vs_packed` isolates what speculation adds.
PLAIN_PACKED = "plain_packed"
#: Plain `generate()` on the exact kernels: the same-kernels baseline of a `kernels="exact"` evaluation
#: (`speedup_vs_exact`), and the run speculative greedy output is identical to by construction.
PLAIN_EXACT = "plain_exact"
#: The baseline method that runs plain `generate()` on each kernel mode other than stock.
PLAIN_ON = {"packed": PLAIN_PACKED, "exact": PLAIN_EXACT}
#: Sets with a task metric: GSM8K answer accuracy and HumanEval pass@1.
TASK_METRICS = {"gsm8k": ("gsm8k_accuracy", "accuracy"), "humaneval": ("humaneval_pass_at_1", "pass@1")}


# ---------------------------------------------------------------------- per-position statistics (pure)
def rounds_of(stats) -> list[tuple[int, int]]:
    """`(verified, accepted)` per round of a [`GenerationStats`] (all that the acceptance curves need). A round
    whose tokens prompt lookup copied counts as verifying no drafted token, so the acceptance curves are the
    draft's alone while τ (accepted + 1 per round) counts every token."""
    return [(r.verified if getattr(r, "source", "draft") == "draft" else 0, r.accepted) for r in stats.rounds]


def _ratio(num: int, den: int) -> float:
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
        out["prefix_survival"].append(_ratio(sum(a >= k for a in verified), len(verified)))
        out["conditional_acceptance"].append(_ratio(sum(a >= k for a in reached), len(reached)))
        out["reached"].append(len(reached))
        out["verified_at"].append(len(verified))
    n = len(rounds)
    out["rounds"] = n
    out["tau"] = _ratio(sum(a + 1 for _, a in rounds), n)
    out["mean_verified"] = _ratio(sum(v for v, _ in rounds), n)
    out["mean_accepted"] = _ratio(sum(a for _, a in rounds), n)
    out["verify_rate"] = _ratio(sum(v for v, _ in rounds), n * block_size)
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
    p1, p2 = _ratio(sum(map(bool, plain)), n), _ratio(sum(map(bool, other)), n)
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


def _nanmean(values: Iterable[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def _temp_key(temperature: float) -> str:
    return f"{temperature:g}"


# ---------------------------------------------------------------------- the report
@dataclass
class PromptRun:
    """One method on one prompt at one temperature: times of every repeat, the output, and its rounds."""

    set_name: str
    prompt_id: str
    temperature: float
    method: str
    seconds: list[float]
    output_ids: list[int]
    reply: str
    rounds: list[tuple[int, int]] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class EvalReport:
    """Everything one evaluation measured; summaries are computed from the per-prompt runs on demand.

    Args:
        config (`dict`): run settings (target, sets, temperatures, policy, max_new_tokens, repeats, seed, …).
        methods (`dict[str, dict]`): per method (`"plain"`, each draft's name, `"prompt_lookup"`) its `kind`
            and, for drafts, `block_size` and where it came from.
        runs (`list[PromptRun]`): one entry per set × temperature × prompt × method.
        quality (`dict`): the parity checks filled by [`quality_checks`].
    """

    config: dict
    methods: dict[str, dict]
    runs: list[PromptRun]
    quality: dict = field(default_factory=dict)

    @property
    def sets(self) -> list[str]:
        return list(dict.fromkeys(r.set_name for r in self.runs))

    @property
    def temperatures(self) -> list[str]:
        return list(dict.fromkeys(_temp_key(r.temperature) for r in self.runs))

    @property
    def drafts(self) -> list[str]:
        return [m for m, info in self.methods.items() if info["kind"] == "draft"]

    def _select(self, set_name: str, temp: str, method: str) -> list[PromptRun]:
        return [
            r for r in self.runs if r.set_name == set_name and _temp_key(r.temperature) == temp and r.method == method
        ]

    def summary(self) -> dict:
        """`{set: {temperature: {method: metrics}}}`: tokens/s, speedup over plain, and for drafts τ and the
        acceptance curves of [`acceptance_curves`] over all rounds of all prompts."""
        out = {}
        for set_name in self.sets:
            for temp in self.temperatures:
                cell = {}
                for method, info in self.methods.items():
                    runs = self._select(set_name, temp, method)
                    if not runs:
                        continue
                    tokens = sum(len(r.output_ids) for r in runs)
                    seconds = sum(r.median_seconds for r in runs)
                    cell[method] = {"prompts": len(runs), "new_tokens": tokens, "seconds": seconds}
                    cell[method]["tokens_per_s"] = _ratio(tokens, seconds)
                    if info["kind"] == "draft":
                        rounds = [x for r in runs for x in r.rounds]
                        cell[method].update(acceptance_curves(rounds, info["block_size"]))
                plain = cell.get(PLAIN, {}).get("tokens_per_s", float("nan"))
                for metrics in cell.values():
                    metrics["speedup"] = metrics["tokens_per_s"] / plain if plain else float("nan")
                for mode, base in PLAIN_ON.items():
                    tps = cell.get(base, {}).get("tokens_per_s")
                    if tps is not None:
                        for metrics in cell.values():
                            metrics[f"speedup_vs_{mode}"] = metrics["tokens_per_s"] / tps if tps else float("nan")
                out.setdefault(set_name, {})[temp] = cell
        return out

    def macro(self, summary: dict | None = None) -> dict:
        """`{temperature: {method: metrics}}` over sets.

        Tokens/s, speedups, τ and the verification means are the unweighted mean over sets (each set counts
        once). The acceptance curves pool the rounds of all sets ([`acceptance_curves`] over their union),
        with their counts `reached` / `verified_at` / `rounds`: averaging per-set curves would count a
        position reached by 2 rounds in one set as much as one reached by hundreds in another.
        """
        summary = summary or self.summary()
        out = {}
        for temp in self.temperatures:
            for method in self.methods:
                cells = [summary[s][temp][method] for s in self.sets if method in summary[s].get(temp, {})]
                if not cells:
                    continue
                keys = ("tokens_per_s", "speedup") + tuple(
                    f"speedup_vs_{mode}" for mode, base in PLAIN_ON.items() if base in self.methods
                )
                agg = {key: _nanmean(c[key] for c in cells) for key in keys}
                if self.methods[method]["kind"] == "draft":
                    for key in ("tau", "mean_verified", "verify_rate", "mean_accepted"):
                        agg[key] = _nanmean(c[key] for c in cells)
                    rounds = [x for s in self.sets for r in self._select(s, temp, method) for x in r.rounds]
                    pooled = acceptance_curves(rounds, self.methods[method]["block_size"])
                    for key in ("prefix_survival", "conditional_acceptance", "reached", "verified_at", "rounds"):
                        agg[key] = pooled[key]
                out.setdefault(temp, {})[method] = agg
        return out

    def to_json(self) -> dict:
        """Settings, summaries, macro averages, quality checks and every per-prompt run, JSON-safe."""
        summary = self.summary()
        return json_safe(
            {
                "config": self.config,
                "methods": self.methods,
                "summary": summary,
                "macro_average": self.macro(summary),
                "quality": self.quality,
                "runs": [asdict(r) for r in self.runs],
            }
        )

    @classmethod
    def from_json(cls, data: dict) -> EvalReport:
        """Rebuild a report from [`to_json`]'s output (e.g. a saved `results.json`), to re-render or re-plot it."""
        runs = [PromptRun(**{**r, "rounds": [tuple(x) for x in r["rounds"]]}) for r in data["runs"]]
        return cls(data["config"], data["methods"], runs, data.get("quality", {}))

    def to_markdown(self) -> str:
        """Markdown tables: τ and speedups per set (with a macro-average row), acceptance by position, quality."""
        return _markdown(self)

    def plot(self, output_dir: str | Path) -> list[Path]:
        """Write the PNG plots (conditional acceptance, prefix survival, speedup) to `output_dir`."""
        return _plots(self, Path(output_dir))

    def save(self, output_dir: str | Path, plots: bool = True) -> list[Path]:
        """Write `results.json`, `results.md` and (with `plots`) the PNG plots to `output_dir`."""
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        (folder / "results.md").write_text(self.to_markdown(), encoding="utf-8")
        files = [folder / "results.json", folder / "results.md"]
        return files + (self.plot(folder) if plots else [])


# ---------------------------------------------------------------------- Markdown and plots
def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _on_device(config: dict) -> str:
    """`" on cuda:0"` for a run on a GPU; empty for the CPU (and for reports written before devices were recorded)."""
    device = config.get("device", "cpu")
    return "" if device == "cpu" else f" on {device}"


def _policy_text(policy) -> str:
    """The run's `policy` setting in words: one spec, `default` (generate()'s own choice), or one per method."""
    if isinstance(policy, Mapping):
        return ", ".join(f"{m}: {p or 'default'}" for m, p in policy.items())
    return policy or "default"


def _resolved_policies(report: EvalReport) -> str:
    """` (dspark: HardwareAwarePolicy(...))`: the policy each draft actually ran with, when recorded."""
    used = [f"{d}: {report.methods[d]['policy']}" for d in report.drafts if report.methods[d].get("policy")]
    return f" ({'; '.join(used)})" if used else ""


def _label(method: str) -> str:
    return _LABELS.get(method, method)


_LABELS = {
    PLAIN: "plain",
    PROMPT_LOOKUP: "prompt lookup",
    PLAIN_PACKED: "plain (packed)",
    PLAIN_EXACT: "plain (exact kernels)",
}


def _speed_table(sets, summary: dict, macro: dict, temp: str, base: str, key: str, methods: list[str]) -> str:
    """Per set and macro: the `base` method's tokens/s, then each method's `key` speedup over it."""
    cells = [(s, summary[s][temp]) for s in sets] + [("**macro average**", macro)]
    rows = [
        [name, _fmt(cell[base]["tokens_per_s"], ".1f")] + [_fmt(cell.get(m, {}).get(key), ".2f") + "×" for m in methods]
        for name, cell in cells
    ]
    return _table(["set", f"{_label(base)} tok/s", *(_label(m) for m in methods)], rows)


def _markdown(report: EvalReport) -> str:
    summary, macro = report.summary(), report.macro()
    c = report.config
    drafts = report.drafts
    gammas = ", ".join(
        f"{d} (γ={report.methods[d]['block_size']}{', fresh/untrained' if report.methods[d].get('fresh') else ''})"
        for d in drafts
    )
    out = [
        "# dspark eval",
        "",
        f"Target `{c.get('target')}` ({c.get('target_dtype')}{_on_device(c)}), drafts: {gammas}; "
        f"policy `{_policy_text(c.get('policy'))}`{_resolved_policies(report)}, "
        f"max {c.get('max_new_tokens')} new tokens, {c.get('repeats')} timed repeat(s), seed {c.get('seed')}, "
        f"{c.get('torch_threads')} torch threads, speculative runs on the `{c.get('kernels', 'stock')}` kernels. "
        "Prompts per set: " + ", ".join(f"{s} {n}" for s, n in c.get("sets", {}).items()) + ".",
        "",
        "τ = mean tokens per target forward (accepted drafts + the target's own token). Speedup = tokens/s over "
        "plain `generate()` on the stock kernels measured in this run, methods interleaved prompt by prompt.",
    ]
    for temp in report.temperatures:
        others = [m for m in report.methods if m != PLAIN and any(m in summary[s].get(temp, {}) for s in report.sets)]
        out += ["", f"## Temperature {temp}" + (" (greedy)" if temp == "0" else " (sampling)"), "", "### τ", ""]
        rows = [[s] + [_fmt(summary[s][temp].get(d, {}).get("tau")) for d in drafts] for s in report.sets]
        rows.append(["**macro average**"] + [_fmt(macro[temp].get(d, {}).get("tau")) for d in drafts])
        out.append(_table(["set", *drafts], rows))
        out += ["", "### Speed (tokens/s) and speedup over plain generate()", ""]
        out.append(_speed_table(report.sets, summary, macro[temp], temp, PLAIN, "speedup", others))
        for mode, base in PLAIN_ON.items():
            if base not in others:
                continue
            rest = [m for m in others if m != base]
            same = mode == c.get("kernels")
            why = (
                " (the kernels speculative decoding uses here, so this is what speculation itself adds)" if same else ""
            )
            out += ["", f"Speedup over plain `generate()` on the {mode} kernels{why}:", ""]
            out.append(_speed_table(report.sets, summary, macro[temp], temp, base, f"speedup_vs_{mode}", rest))
        gamma = max(report.methods[d]["block_size"] for d in drafts)
        for key, count, title in (
            ("conditional_acceptance", "reached", "Conditional acceptance P(k accepted | 1..k−1 accepted)"),
            ("prefix_survival", "verified_at", "Prefix survival P(1..k all accepted)"),
        ):
            out += ["", f"### {title}, pooled over the rounds of all sets", ""]
            rows = []
            for d in drafts:
                pad = ["–"] * (gamma - len(macro[temp][d][key]))
                rows.append([d] + [_fmt(v) for v in macro[temp][d][key]] + pad)
                rows.append([f"{d}: rounds"] + [str(n) for n in macro[temp][d][count]] + pad)
            out.append(_table(["draft", *(f"k={k}" for k in range(1, gamma + 1))], rows))
        out += ["", "### Verification, macro average", ""]
        rows = [
            [d, _fmt(macro[temp][d]["mean_verified"]), _fmt(100 * macro[temp][d]["verify_rate"], ".1f") + "%",
             _fmt(macro[temp][d]["mean_accepted"])]
            for d in drafts
        ]  # fmt: skip
        out.append(_table(["draft", "mean verified length", "verify rate", "mean accepted"], rows))
    out += _markdown_quality(report)
    return "\n".join(out) + "\n"


def _markdown_quality(report: EvalReport) -> list[str]:
    q = report.quality
    out = []
    mode = report.config.get("kernels", "stock")
    titles = {
        "greedy_identity_same_kernels": f"Greedy identity with plain generate() on the same ({mode}) kernels "
        "(token exact match, must be 1.0)",
        "greedy_identity": "Greedy identity with plain generate() on the stock kernels (token exact match"
        + (
            "; on other kernels it holds unless a near-tie of two logits falls differently)" if mode != "stock" else ")"
        ),
    }
    for key, title in titles.items():
        if not q.get(key) or (key == "greedy_identity_same_kernels" and mode == "stock"):
            continue
        out += ["", f"## {title}", ""]
        rows = [
            [s, _label(m), _fmt(v["exact_match"], ".3f"), ", ".join(v["mismatched"]) or "–"]
            for s, cell in q[key].items()
            for m, v in cell.items()
        ]
        out.append(_table(["set", "method", "exact match", "mismatched prompts"], rows))
    if q.get("task_accuracy"):
        out += ["", "## Task accuracy with and without speculation", ""]
        rows = []
        for s, temps in q["task_accuracy"].items():
            for temp, cell in temps.items():
                for m, acc in cell["accuracy"].items():
                    if temp == "0":
                        check = "–" if m == PLAIN else ("equal" if cell["equal_to_plain"][m] else "**DIFFERENT**")
                    elif m == PLAIN:
                        check = "–"
                    else:
                        t = cell["tests"][m]
                        check = f"McNemar p={t['mcnemar_exact_p']:.3f} ({'within noise' if t['within_noise'] else '**differs**'})"
                    rows.append([s, temp, cell["metric"], _label(m), _fmt(100 * acc, ".1f") + "%", check])
        out.append(_table(["set", "T", "metric", "method", "score", "vs plain"], rows))
    return out


#: fewest rounds behind a plotted point of an acceptance curve (the tables show every point with its count)
MIN_CURVE_ROUNDS = 20
#: the count behind each curve: the rounds that reached position k, or that verified it
_CURVE_COUNTS = {"conditional_acceptance": "reached", "prefix_survival": "verified_at"}


def _thin_curve(values: list, counts: list | None, min_rounds: int = MIN_CURVE_ROUNDS) -> list[float]:
    """The curve to plot: NaN (a gap) where a point has no value or fewer than `min_rounds` rounds behind it.

    A conditional acceptance at the block's end often rests on one or two rounds, and a lone 1.0 or 0.0
    there reads as a finding; the tables keep every point with its count.
    """
    nan = float("nan")
    if counts is None:
        return [nan if v is None else v for v in values]
    return [nan if v is None or c < min_rounds else v for v, c in zip(values, counts)]


def _plots(report: EvalReport, folder: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Evaluation plots need matplotlib: pip install -e '.[eval]' in your dspark-hf clone") from err
    folder.mkdir(parents=True, exist_ok=True)
    summary, macro = report.summary(), report.macro()
    temps, sets, drafts = report.temperatures, report.sets, report.drafts
    gamma = max(report.methods[d]["block_size"] for d in drafts)
    colors = {m: f"C{i}" for i, m in enumerate(m for m in report.methods if m != PLAIN)}  # same color everywhere
    files = []

    def grid(rows, cols, width, height):
        return plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, sharey=True)

    def save(fig, name):
        fig.tight_layout()
        files.append(folder / name)
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)

    def curve_panel(ax, cells, key, title):
        for d in drafts:
            if d in cells:
                ys = _thin_curve(cells[d][key], cells[d].get(_CURVE_COUNTS[key]))
                ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, color=colors[d], label=d)
        ax.set(title=title, xlabel="draft position k", ylim=(0, 1.02), xlim=(0.5, gamma + 0.5))
        ax.title.set_fontsize(9)
        ax.set_xticks(range(1, gamma + 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    for key, ylabel in (("conditional_acceptance", "P(k accepted | 1..k−1 accepted)"),
                        ("prefix_survival", "P(1..k all accepted)")):  # fmt: skip
        fig, axes = grid(1, len(temps), 4.5, 3.8)
        for ax, temp in zip(axes[0], temps):
            title = f"T={temp}, rounds of {len(sets)} set(s) pooled, points from ≥ {MIN_CURVE_ROUNDS} rounds"
            curve_panel(ax, macro[temp], key, title)
        axes[0][0].set_ylabel(ylabel)
        save(fig, f"{key}.png")

    fig, axes = grid(len(sets), len(temps), 4.2, 3.0)
    for i, s in enumerate(sets):
        for j, temp in enumerate(temps):
            title = f"{s}, T={temp} (points from ≥ {MIN_CURVE_ROUNDS} rounds)"
            curve_panel(axes[i][j], summary[s].get(temp, {}), "conditional_acceptance", title)
        axes[i][0].set_ylabel("conditional acceptance")
    save(fig, "conditional_acceptance_by_set.png")

    fig, axes = grid(1, len(temps), 5.0, 3.8)
    groups = [*sets, "macro"]
    for ax, temp in zip(axes[0], temps):
        others = [m for m in colors if m in macro[temp]]
        width = 0.8 / max(len(others), 1)
        for n, m in enumerate(others):
            ys = [summary[s].get(temp, {}).get(m, {}).get("speedup", float("nan")) for s in sets]
            ys.append(macro[temp][m]["speedup"])
            ax.bar([g + n * width for g in range(len(groups))], ys, width=width, color=colors[m], label=_label(m))
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks([g + width * (len(others) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
        ax.set_title(f"T={temp}: speedup over plain generate()", fontsize=9)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("tokens/s ratio (same run)")
    save(fig, "speedup.png")
    return files


# ---------------------------------------------------------------------- quality parity
def quality_checks(report: EvalReport, items: Mapping[str, Sequence[PromptItem]], task_metrics: bool = True) -> dict:
    """Greedy identity (token exact match at temperature 0) and, with `task_metrics`, GSM8K accuracy / HumanEval
    pass@1 per method, compared with plain generation.

    Identity is checked twice: `greedy_identity` against plain `generate()` on the stock kernels (what a user of
    plain `generate()` gets; on other kernels it holds only as long as no near-tie of two logits falls
    differently), and `greedy_identity_same_kernels` against plain `generate()` on the kernels the speculative
    runs used (must be 1.0; in the exact mode it holds by construction).

    At temperature 0 a method's accuracy must equal plain generation's (`equal_to_plain`); at a sampling
    temperature [`paired_accuracy_test`] says whether the difference is within sampling noise.
    """
    by_id = {(s, item.id): item for s, rows in items.items() for item in rows}
    quality = {"greedy_identity": {}, "greedy_identity_same_kernels": {}, "task_accuracy": {}}
    same = PLAIN_ON.get(report.config.get("kernels", "stock"), PLAIN)
    if "0" in report.temperatures:
        exact = load_metric("token_exact_match")
        for key, base in (("greedy_identity", PLAIN), ("greedy_identity_same_kernels", same)):
            for set_name in report.sets:
                plain = report._select(set_name, "0", base)
                for method in report.methods:
                    runs = report._select(set_name, "0", method)
                    if (
                        method == base
                        or not runs
                        or (key != "greedy_identity" and method in (PLAIN, *PLAIN_ON.values()))
                    ):
                        continue
                    scores = exact.compute(
                        predictions=[token_string(r.output_ids) for r in runs],
                        references=[token_string(r.output_ids) for r in plain],
                    )
                    quality[key].setdefault(set_name, {})[method] = {
                        "exact_match": scores["exact_match"],
                        "mismatched": [r.prompt_id for r, ok in zip(runs, scores["matches"]) if not ok],
                    }
    if not task_metrics:
        return quality
    for set_name in (s for s in report.sets if s in TASK_METRICS):
        metric_name, key = TASK_METRICS[set_name]
        metric = load_metric(metric_name)
        for temp in report.temperatures:
            methods = [m for m in report.methods if report._select(set_name, temp, m)]
            runs = {m: report._select(set_name, temp, m) for m in methods}
            # one compute over every method, so identical replies (all of them, greedily) are scored once
            flat = [r for m in methods for r in runs[m]]
            refs = [_task_reference(by_id[(set_name, r.prompt_id)]) for r in flat]
            scores = metric.compute(predictions=[r.reply for r in flat], references=refs)
            correct, start = {}, 0
            for m in methods:
                correct[m] = scores["correct"][start : start + len(runs[m])]
                start += len(runs[m])
            cell = {"metric": key, "accuracy": {m: _ratio(sum(c), len(c)) for m, c in correct.items()}}
            cell["correct"] = {m: [bool(x) for x in c] for m, c in correct.items()}
            for m in methods:
                if m == PLAIN:
                    continue
                if temp == "0":
                    cell.setdefault("equal_to_plain", {})[m] = cell["accuracy"][m] == cell["accuracy"][PLAIN]
                else:
                    cell.setdefault("tests", {})[m] = paired_accuracy_test(correct[PLAIN], correct[m])
            quality["task_accuracy"].setdefault(set_name, {})[temp] = cell
    return quality


def _task_reference(item: PromptItem) -> str:
    if item.set_name == "gsm8k":
        return str(item.reference["answer"])
    return item.reference["task"]["task_id"]


# ---------------------------------------------------------------------- running it
def synchronize(device) -> None:
    """Wait for queued GPU work on `device` (a no-op on the CPU), so wall-clock timings include it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generation_configs(target, tokenizer, temperature: float, max_new_tokens: int, lookup_tokens: int):
    from transformers import GenerationConfig

    sample = temperature > 0
    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # top_k=0 / top_p=1.0, not None: transformers fills None with its defaults (top-k 50), which would not be
    # the paper's plain temperature sampling.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    lookup = GenerationConfig(**config.to_diff_dict())
    lookup.prompt_lookup_num_tokens = lookup_tokens
    return config, lookup


def evaluate_drafts(
    target,
    tokenizer,
    drafts: Mapping,
    sets: Sequence[str] = EVAL_SETS,
    *,
    limit: int | None = None,
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 256,
    repeats: int = 1,
    policy: str | Mapping[str, str | None] | None = None,
    cuda_graphs: bool | Mapping[str, bool | None] | None = None,
    lookup: bool | Mapping[str, bool | None] | None = None,
    seed: int = 0,
    prompt_lookup: bool = True,
    prompt_lookup_num_tokens: int = 10,
    packed_baseline: bool | None = None,
    task_metrics: bool = True,
    prompts: Mapping[str, Sequence[PromptItem]] | None = None,
    progress: bool = True,
    kernels: str | None = None,
) -> EvalReport:
    """Evaluate `drafts` with `target` on prompt sets; plain and speculative runs interleaved per prompt.

    For every set × temperature × prompt, each repeat runs plain `generate()`, then each draft (and, at
    temperature 0 with `prompt_lookup`, prompt lookup decoding) with the same seed (`seed` + the prompt's
    index), so all methods see the same machine load and, at temperature 0, must produce the same tokens.

    Args:
        target (`PreTrainedModel`): the target model.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template (prompts are user turns).
        drafts (`Mapping[str, DSparkDraftModel]`): drafts bound to `target`, by the name used in the report.
        sets (`Sequence[str]`, *optional*, defaults to all of `EVAL_SETS`): prompt sets to load.
        limit (`int`, *optional*): first `limit` prompts of each set (default: all).
        temperatures (`Sequence[float]`, *optional*, defaults to `(0.0, 1.0)`): 0 is greedy; above 0 is plain
            sampling at that temperature (no top-k / top-p).
        max_new_tokens (`int`, *optional*, defaults to 256): per generation.
        repeats (`int`, *optional*, defaults to 1): timed repeats per method and prompt; medians are used.
        policy (`str` or `Mapping[str, str]`, *optional*): `dspark_policy` for every draft, or one per draft
            name. `None` (the default, also as a mapping's value) measures what users get: the draft runs with
            the policy `generate()` picks for it without a `dspark_policy` argument (the draft's own `policy`,
            its config's `default_policy`, else the product default, see [`resolve_policy`]); the policy each draft ran with is recorded in
            `report.methods[name]["policy"]`. `"fixed"` verifies the whole block, so τ is compared at full
            γ, as in the paper.
        cuda_graphs (`bool` or `Mapping[str, bool]`, *optional*): `dspark_cuda_graphs` for every draft, or one
            per draft name; `None` leaves `generate()`'s own choice (on for a CUDA draft). Whether the graph path
            ran is recorded in `report.methods[name]["cuda_graphs"]`.
        lookup (`bool` or `Mapping[str, bool]`, *optional*): `dspark_lookup` for every draft, or one per draft
            name (prompt lookup before drafting, `dspark_hf.decoding.lookup`); `None` leaves `generate()`'s default.
        seed (`int`, *optional*, defaults to 0): base seed.
        prompt_lookup (`bool`, *optional*, defaults to `True`): also time prompt lookup decoding at temperature 0.
        prompt_lookup_num_tokens (`int`, *optional*, defaults to 10): its `prompt_lookup_num_tokens`.
        packed_baseline (`bool`, *optional*): also time plain `generate()` with the target's linears packed
            (`"plain_packed"`, see `dspark_hf.model.cpu_packing`). Defaults to whether speculative decoding packs
            them here (on a CPU with packing enabled).
        kernels (`str`, *optional*): the kernel mode of the speculative and prompt-lookup runs (`"stock"`,
            `"packed"`, `"exact"`; see `dspark_hf.model.kernels`). Defaults to what `generate()` uses without a
            `dspark_kernels` argument. Plain `generate()` on the stock kernels (`"plain"`) is always timed;
            for another mode, plain `generate()` on that mode's kernels is timed too (`"plain_exact"` /
            `"plain_packed"`, with `speedup_vs_exact` / `speedup_vs_packed`), so the report separates what the
            kernels give from what speculation gives.
        task_metrics (`bool`, *optional*, defaults to `True`): score GSM8K / HumanEval replies.
        prompts (`Mapping[str, Sequence[PromptItem]]`, *optional*): use these prompts instead of loading `sets`.
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bars.

    Returns:
        [`EvalReport`]: with the quality checks filled in.
    """
    import torch
    from tqdm.auto import tqdm

    from ..default_model import chat_inputs
    from ..model.cpu_packing import cpu_packing_enabled
    from ..model.kernels import _check_mode, default_kernels

    reserved = {PLAIN, PROMPT_LOOKUP, *PLAIN_ON.values()} & set(drafts)
    if not drafts or reserved:
        raise ValueError(
            f"Got drafts named {sorted(drafts)}; pass at least one draft, and none named {PLAIN!r}, "
            f"{PLAIN_PACKED!r}, {PLAIN_EXACT!r} or {PROMPT_LOOKUP!r} (those names are the baselines)."
        )
    mode = _check_mode(kernels) if kernels is not None else default_kernels()
    if repeats < 1 or max_new_tokens < 1 or any(t < 0 for t in temperatures):
        raise ValueError(
            f"Got repeats={repeats}, max_new_tokens={max_new_tokens}, temperatures={list(temperatures)}; "
            "repeats and max_new_tokens must be >= 1 and temperatures >= 0."
        )
    items = dict(prompts) if prompts is not None else {s: load_prompt_set(s, limit) for s in sets}
    methods = {PLAIN: {"kind": "plain", "kernels": "stock"}}
    if mode != "stock":
        methods[PLAIN_ON[mode]] = {"kind": f"plain_{mode}", "kernels": mode}
    if packed_baseline is None:
        packed_baseline = mode == "packed" or (cpu_packing_enabled() and target.device.type == "cpu")
    if packed_baseline:
        methods[PLAIN_PACKED] = {"kind": "plain_packed", "kernels": "packed"}
    for name, draft in drafts.items():
        methods[name] = {
            "kind": "draft",
            "block_size": int(draft.config.block_size),
            "source": getattr(draft.config, "name_or_path", "") or "",
        }
    if prompt_lookup and 0 in temperatures:
        methods[PROMPT_LOOKUP] = {"kind": "prompt_lookup", "num_tokens": prompt_lookup_num_tokens}

    def run_once(inputs, method, configs, run_seed):
        config, lookup_config = configs
        kwargs = {"generation_config": lookup_config if method == PROMPT_LOOKUP else config}
        kwargs["dspark_kernels"] = methods[method].get("kernels", mode)  # drafts and prompt lookup: `mode`
        if method in drafts:
            kwargs["assistant_model"] = drafts[method]
            spec = policy.get(method) if isinstance(policy, Mapping) else policy
            if spec is not None:  # otherwise generate()'s own default, as a user gets it
                kwargs["dspark_policy"] = spec
            graphs = cuda_graphs.get(method) if isinstance(cuda_graphs, Mapping) else cuda_graphs
            if graphs is not None:
                kwargs["dspark_cuda_graphs"] = graphs
            look = lookup.get(method) if isinstance(lookup, Mapping) else lookup
            if look is not None:
                kwargs["dspark_lookup"] = look
        torch.manual_seed(run_seed)
        synchronize(target.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**inputs, **kwargs)
        synchronize(target.device)  # a GPU runs asynchronously: count the work, not just its launch
        seconds = time.perf_counter() - start
        rounds = rounds_of(drafts[method].last_generation_stats) if method in drafts else []
        return out[0, inputs["input_ids"].shape[1] :].tolist(), seconds, rounds

    # warm-up (first-call allocations and lazy initialisation), not reported
    first = next((rows[0] for rows in items.values() if rows), None)
    if first is not None:
        warm = chat_inputs(tokenizer, first.prompt, target.device)
        for temp in temperatures:
            configs = _generation_configs(target, tokenizer, temp, min(8, max_new_tokens), prompt_lookup_num_tokens)
            for method in methods:
                if method != PROMPT_LOOKUP or temp == 0:
                    run_once(warm, method, configs, seed)
                # the policy each method runs with, as its own warm-up run resolved it (read right after that
                # run: methods NAME@POLICY share one draft object, whose last stats are the last method's)
                stats = getattr(drafts.get(method), "last_generation_stats", None)
                if stats is not None and "policy" not in methods[method]:
                    methods[method]["policy"] = stats.policy
                    methods[method]["cuda_graphs"] = stats.cuda_graphs

    runs = []
    for set_name, rows in items.items():
        for temp in temperatures:
            configs = _generation_configs(target, tokenizer, temp, max_new_tokens, prompt_lookup_num_tokens)
            active = [m for m in methods if m != PROMPT_LOOKUP or temp == 0]
            bar = tqdm(rows, desc=f"{set_name} T={temp:g}", disable=not progress, leave=False)
            for index, item in enumerate(bar):
                inputs = chat_inputs(tokenizer, item.prompt, target.device)
                seconds = {m: [] for m in active}
                outputs = {}
                for _ in range(repeats):
                    for method in active:  # interleaved: every method sees the same machine load
                        ids, dt, rounds = run_once(inputs, method, configs, seed + index)
                        seconds[method].append(dt)
                        outputs[method] = (ids, rounds)
                for method in active:
                    ids, rounds = outputs[method]
                    reply = tokenizer.decode(ids, skip_special_tokens=True)
                    runs.append(PromptRun(set_name, item.id, float(temp), method, seconds[method], ids, reply, rounds))
                taus = {m: _ratio(sum(a + 1 for _, a in outputs[m][1]), len(outputs[m][1])) for m in drafts}
                bar.set_postfix({f"τ {m}": f"{t:.2f}" for m, t in taus.items()})

    config = {
        "target": getattr(target.config, "name_or_path", ""),
        "target_dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "device": str(target.device),
        "sets": {s: len(rows) for s, rows in items.items()},
        "temperatures": [float(t) for t in temperatures],
        "sampling": "plain temperature sampling (top_k=0, top_p=1.0); greedy at temperature 0",
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "policy": dict(policy) if isinstance(policy, Mapping) else policy,
        "cuda_graphs": dict(cuda_graphs) if isinstance(cuda_graphs, Mapping) else cuda_graphs,
        "lookup": dict(lookup) if isinstance(lookup, Mapping) else lookup,
        "seed": seed,
        "torch_threads": torch.get_num_threads(),
        "kernels": mode,
        "timing": "per prompt, methods interleaved in every repeat; tokens/s = new tokens / median seconds, summed",
    }
    report = EvalReport(config, methods, runs)
    report.quality = quality_checks(report, items, task_metrics=task_metrics)
    return report
