"""An [`EvalReport`][dspark_hf.evaluation.report.EvalReport] as PNG plots: acceptance by position (pooled and per
set) and speedups, and the one-picture summary the docs show ([`plot_speedup_by_set`]: the draft alone and with
prompt lookup, over plain decoding on the same kernels and over stock `generate()`). matplotlib (the `eval`
extra) is imported only when plotting."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .methods import PLAIN, PLAIN_ON, label

#: fewest rounds behind a plotted point of an acceptance curve (the tables show every point with its count)
MIN_CURVE_ROUNDS = 20
#: the count behind each curve: the rounds that reached position k, or that verified it
_CURVE_COUNTS = {"conditional_acceptance": "reached", "prefix_survival": "verified_at"}


def thin_curve(values: list, counts: list | None, min_rounds: int = MIN_CURVE_ROUNDS) -> list[float]:
    """The curve to plot: NaN (a gap) where a point has no value or fewer than `min_rounds` rounds behind it.

    A conditional acceptance at the block's end often rests on one or two rounds, and a lone 1.0 or 0.0
    there reads as a finding; the tables keep every point with its count.
    """
    nan = float("nan")
    if counts is None:
        return [nan if v is None else v for v in values]
    return [nan if v is None or c < min_rounds else v for v, c in zip(values, counts)]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Evaluation plots need matplotlib: pip install -e '.[eval]' in your dspark-hf clone") from err
    return plt


def speedup_bars(ax, groups: Sequence[str], bars: Sequence[tuple[str, Sequence[float], dict]], values=False) -> None:
    """Grouped bars on `ax`: one group per name in `groups`, one bar per entry of `bars` in each group, and a
    dashed line at 1.0 (as fast as the baseline).

    Each entry of `bars` is `(legend label, one speedup per group (NaN: none), keyword arguments of ax.bar)`;
    with `values` each bar is labelled with its figure.
    """
    width = 0.8 / max(len(bars), 1)
    for n, (name, ys, style) in enumerate(bars):
        xs = [g + n * width for g in range(len(groups))]
        drawn = ax.bar(xs, ys, width=width, label=name, **style)
        if values:
            ax.bar_label(drawn, labels=["" if math.isnan(y) else f"{y:.2f}×" for y in ys], fontsize=6.5, padding=1)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([g + width * (len(bars) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)


def plot_report(report, folder: Path) -> list[Path]:
    """Write `conditional_acceptance.png`, `prefix_survival.png`, `conditional_acceptance_by_set.png` and
    `speedup.png` for `report` to `folder`; returns their paths."""
    plt = _pyplot()
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
                ys = thin_curve(cells[d][key], cells[d].get(_CURVE_COUNTS[key]))
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
        bars = []
        for m in (m for m in colors if m in macro[temp]):
            ys = [summary[s].get(temp, {}).get(m, {}).get("speedup", float("nan")) for s in sets]
            bars.append((label(m), [*ys, macro[temp][m]["speedup"]], {"color": colors[m]}))
        speedup_bars(ax, groups, bars)
        ax.set_title(f"T={temp}: speedup over plain generate()", fontsize=9)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("tokens/s ratio (same run)")
    save(fig, "speedup.png")
    return files


def lookup_methods(report) -> dict[bool, list[str]]:
    """The report's drafts by whether they ran with prompt lookup before drafting: `{False: [...], True: [...]}`.

    Read from `report.config["lookup"]` (one value for every draft, or one per draft, as `dspark eval --lookup off
    on` records it); a draft that ran with its own default (`None`) is in neither list.
    """
    recorded = report.config.get("lookup")
    out: dict[bool, list[str]] = {False: [], True: []}
    for method in report.drafts:
        value = recorded.get(method) if isinstance(recorded, dict) else recorded
        if value is not None:
            out[bool(value)].append(method)
    return out


def _one_draft(report, given: str | None, candidates: list[str], role: str) -> str:
    if given is not None:
        if given not in report.drafts:
            raise ValueError(f"{given!r} is not a draft of this report; its drafts: {', '.join(report.drafts)}.")
        return given
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"The report has no draft that ran {role}: evaluate with `dspark eval --lookup off on` (its drafts: "
            f"{', '.join(report.drafts) or 'none'}, lookup recorded as {report.config.get('lookup')!r})."
        )
    raise ValueError(f"Several drafts ran {role} ({', '.join(candidates)}): name the one to plot.")


def speedup_by_set(report, alone: str | None = None, with_lookup: str | None = None, temperature: str = "0") -> tuple:
    """The bars of [`plot_speedup_by_set`]: `(groups, bars)` for [`speedup_bars`].

    Groups are the report's prompt sets and their mean (each set counts once); bars are the draft alone and
    lookup + draft, each over plain decoding on the kernels the speculative runs used and over stock
    `generate()` (the same bar twice on stock kernels, so drawn once). `alone` and `with_lookup` name the
    methods; by default, the report's one draft that ran without lookup and its one draft that ran with it
    ([`lookup_methods`]). Raises `ValueError` saying what is missing.
    """
    by_lookup = lookup_methods(report)
    alone = _one_draft(report, alone, by_lookup[False], "without prompt lookup")
    with_lookup = _one_draft(report, with_lookup, by_lookup[True], "with prompt lookup")
    if temperature not in report.temperatures:
        raise ValueError(f"The report has no runs at T={temperature}; it has T={', '.join(report.temperatures)}.")
    summary, macro = report.summary(), report.macro()
    kernels = report.config.get("kernels") or "stock"
    same = f"speedup_vs_{kernels}" if PLAIN_ON.get(kernels) in report.methods else None
    if kernels != "stock" and same is None:
        raise ValueError(f"The report ran on the {kernels} kernels but has no plain run on them to compare with.")
    columns = [(same, f"over plain decoding on the same ({kernels}) kernels")] if same else []
    columns.append(("speedup", "over stock generate()"))
    sets = report.sets
    groups = [*sets, "mean of sets"]
    bars = []
    for key, baseline in columns:
        stock = key == "speedup" and same is not None
        for method, name, color in ((alone, "draft alone", "C0"), (with_lookup, "lookup + draft", "C1")):
            ys = [summary[s].get(temperature, {}).get(method, {}).get(key, float("nan")) for s in sets]
            ys.append(macro[temperature].get(method, {}).get(key, float("nan")))
            style = {"color": color, "alpha": 0.45, "hatch": "//", "edgecolor": "white"} if stock else {"color": color}
            bars.append((f"{name}, {baseline}", ys, style))
    return groups, bars


def plot_speedup_by_set(
    report,
    path: str | Path,
    *,
    alone: str | None = None,
    with_lookup: str | None = None,
    temperature: str = "0",
    draft: str | None = None,
    machine: str | None = None,
    date: str | None = None,
) -> Path:
    """One grouped bar chart of a report's speedups by prompt set ([`speedup_by_set`]), with a dashed line at 1.0,
    written as a PNG to `path`. Its title names the draft, the machine and the date: those the report records
    (`methods[...]["source"]`, `config["machine"]`, `config["date"]`) unless given."""
    plt = _pyplot()
    groups, bars = speedup_by_set(report, alone, with_lookup, temperature)
    config = report.config
    draft = draft or report.methods[with_lookup or lookup_methods(report)[True][0]].get("source", "draft")
    machine = machine or config.get("machine", "an unrecorded machine")
    title = f"{draft} on {machine}, {date or config.get('date', 'undated')}"
    fig, ax = plt.subplots(figsize=(max(6.0, 1.15 * len(groups) + 2.0), 4.2))
    speedup_bars(ax, groups, bars, values=True)
    ax.set_ylabel("speedup (tokens/s ratio, same run)")
    ax.set_ylim(0, max([y for _, ys, _ in bars for y in ys if not math.isnan(y)] + [1.0]) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    prompts = sorted(set(report.config.get("sets", {}).values()))
    detail = f"T={temperature}" + (f", {'/'.join(map(str, prompts))} prompts per set" if prompts else "")
    ax.set_title(f"{title}\n{detail}", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper right", ncols=2 if len(bars) > 2 else 1)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
