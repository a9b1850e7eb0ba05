"""An [`EvalReport`][dspark_hf.evaluation.report.EvalReport] as Markdown tables (`results.md`, and what
`dspark eval` prints)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from .methods import PLAIN, PLAIN_ON, label


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


def _resolved_policies(report) -> str:
    """` (dspark: HardwareAwarePolicy(...))`: the policy each draft actually ran with, when recorded."""
    used = [f"{d}: {report.methods[d]['policy']}" for d in report.drafts if report.methods[d].get("policy")]
    return f" ({'; '.join(used)})" if used else ""


def _speed_table(sets, summary: dict, macro: dict, temp: str, base: str, key: str, methods: list[str]) -> str:
    """Per set and macro: the `base` method's tokens/s, then each method's `key` speedup over it."""
    cells = [(s, summary[s][temp]) for s in sets] + [("**macro average**", macro)]
    rows = [
        [name, _fmt(cell[base]["tokens_per_s"], ".1f")] + [_fmt(cell.get(m, {}).get(key), ".2f") + "×" for m in methods]
        for name, cell in cells
    ]
    return _table(["set", f"{label(base)} tok/s", *(label(m) for m in methods)], rows)


def render_markdown(report) -> str:
    """The report as Markdown: per temperature τ, speeds and speedups, acceptance by position and verification,
    then the quality checks."""
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


def _markdown_quality(report) -> list[str]:
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
            [s, label(m), _fmt(v["exact_match"], ".3f"), ", ".join(v["mismatched"]) or "–"]
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
                    rows.append([s, temp, cell["metric"], label(m), _fmt(100 * acc, ".1f") + "%", check])
        out.append(_table(["set", "T", "metric", "method", "score", "vs plain"], rows))
    return out
