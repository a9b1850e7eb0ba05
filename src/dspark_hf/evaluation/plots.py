"""An [`EvalReport`][dspark_hf.evaluation.report.EvalReport] as PNG plots: acceptance by position (pooled and per
set) and speedups. matplotlib (the `eval` extra) is imported only when plotting."""

from __future__ import annotations

from pathlib import Path

from .methods import PLAIN, label

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


def plot_report(report, folder: Path) -> list[Path]:
    """Write `conditional_acceptance.png`, `prefix_survival.png`, `conditional_acceptance_by_set.png` and
    `speedup.png` for `report` to `folder`; returns their paths."""
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
        others = [m for m in colors if m in macro[temp]]
        width = 0.8 / max(len(others), 1)
        for n, m in enumerate(others):
            ys = [summary[s].get(temp, {}).get(m, {}).get("speedup", float("nan")) for s in sets]
            ys.append(macro[temp][m]["speedup"])
            ax.bar([g + n * width for g in range(len(groups))], ys, width=width, color=colors[m], label=label(m))
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks([g + width * (len(others) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
        ax.set_title(f"T={temp}: speedup over plain generate()", fontsize=9)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("tokens/s ratio (same run)")
    save(fig, "speedup.png")
    return files
