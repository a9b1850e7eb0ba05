"""What an evaluation measured: [`PromptRun`] per method and prompt, [`EvalReport`] with its summaries, and the
quality-parity checks ([`quality_checks`]): greedy identity, GSM8K accuracy and HumanEval pass@1.

Only the standard library and the package's light modules are imported here; `evaluate` and matplotlib are
imported by the functions that use them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..scheduling.calibration import json_safe
from .eval_metrics import load_metric, token_string
from .markdown import render_markdown
from .methods import PLAIN, PLAIN_ON, TASK_METRICS
from .plots import plot_report
from .prompt_sets import PromptItem
from .statistics import acceptance_curves, nanmean, paired_accuracy_test, ratio, temperature_key


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
        return list(dict.fromkeys(temperature_key(r.temperature) for r in self.runs))

    @property
    def drafts(self) -> list[str]:
        return [m for m, info in self.methods.items() if info["kind"] == "draft"]

    def _select(self, set_name: str, temp: str, method: str) -> list[PromptRun]:
        return [
            r
            for r in self.runs
            if r.set_name == set_name and temperature_key(r.temperature) == temp and r.method == method
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
                    cell[method]["tokens_per_s"] = ratio(tokens, seconds)
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
                agg = {key: nanmean(c[key] for c in cells) for key in keys}
                if self.methods[method]["kind"] == "draft":
                    for key in ("tau", "mean_verified", "verify_rate", "mean_accepted"):
                        agg[key] = nanmean(c[key] for c in cells)
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
        return render_markdown(self)

    def plot(self, output_dir: str | Path) -> list[Path]:
        """Write the PNG plots (conditional acceptance, prefix survival, speedup) to `output_dir`."""
        return plot_report(self, Path(output_dir))

    def save(self, output_dir: str | Path, plots: bool = True) -> list[Path]:
        """Write `results.json`, `results.md` and (with `plots`) the PNG plots to `output_dir`."""
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        (folder / "results.md").write_text(self.to_markdown(), encoding="utf-8")
        files = [folder / "results.json", folder / "results.md"]
        return files + (self.plot(folder) if plots else [])


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
            cell = {"metric": key, "accuracy": {m: ratio(sum(c), len(c)) for m, c in correct.items()}}
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
