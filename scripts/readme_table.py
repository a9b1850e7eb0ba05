"""Print the README's results table from `dspark eval` reports made with `--lookup off on`.

    dspark eval --limit 8 --temperatures 0 --max-new-tokens 96 --repeats 1 --threads 2 --lookup off on \\
        --no-task-metrics --output eval-sets
    dspark eval --prompts examples/default_drafts/heldout_own.jsonl --limit 8 --temperatures 0 \\
        --max-new-tokens 96 --repeats 1 --threads 2 --lookup off on --no-task-metrics --output eval-own
    python scripts/readme_table.py eval-sets eval-own

One row per prompt set (each report's sets, in order, then each report's macro average): τ of the draft alone
and with prompt lookup, their speedups over plain decoding on the same kernels (what speculation adds) and over
stock `generate()` (what a user of plain `generate()` gets), and whether every greedy output was identical.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _method(methods, suffix: str) -> str:
    """The one draft method of a `--lookup off on` report whose name ends in `suffix`."""
    found = [m for m in methods if m.endswith(suffix)]
    if len(found) != 1:
        raise SystemExit(f"expected one method named '*{suffix}' (dspark eval --lookup off on), found {found}")
    return found[0]


def report_rows(folder: Path, temperature: str) -> tuple[list[str], dict]:
    """Table rows for one report folder, and its config."""
    report = json.loads((folder / "results.json").read_text())
    alone_name, lookup_name = _method(report["methods"], "@lookup-off"), _method(report["methods"], "@lookup-on")
    rows = []
    summaries = [(name, sets[temperature]) for name, sets in report["summary"].items()]
    label = "macro, " + ("evaluation sets" if len(summaries) > 1 and "gsm8k" in report["summary"] else folder.name)
    summaries.append((f"**{label}**", report["macro_average"][temperature]))
    identity = report.get("quality", {}).get("greedy_identity", {})
    for name, summary in summaries:
        alone, lookup = summary[alone_name], summary[lookup_name]
        sets = list(identity) if "**" in name else [name]
        same = [identity.get(s, {}).get(m, {}).get("exact_match") for s in sets for m in (alone_name, lookup_name)]
        verdict = "–" if not same or None in same else "yes" if all(x == 1.0 for x in same) else "NO"
        rows.append(
            f"| {name} | {alone['tau']:.2f} | {lookup['tau']:.2f} | {alone['speedup_vs_exact']:.2f}× "
            f"| {lookup['speedup_vs_exact']:.2f}× | {summary['plain_exact']['speedup']:.2f}× "
            f"| {alone['speedup']:.2f}× | {lookup['speedup']:.2f}× | {verdict} |"
        )
    return rows, report["config"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="dspark eval output folders")
    parser.add_argument("--temperature", default="0", help="the temperature key of the reports (default: 0)")
    args = parser.parse_args(argv)
    rows, configs = [], []
    for folder in args.reports:
        more, config = report_rows(folder, args.temperature)
        rows += more
        configs.append(config)
    first = configs[0]
    target = first.get("target", "?").split("/")[-1]
    print(
        f"{first.get('date', '?')}, {first.get('machine', '?')}, {target} ({first.get('target_dtype', '?')}) "
        f"with the shipped DSpark draft, temperature {args.temperature}:\n"
    )
    print("| prompt set | τ alone | τ with lookup | alone vs same kernels | with lookup vs same kernels "
          "| exact kernels, no draft, vs stock | alone vs stock | with lookup vs stock | greedy identical |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
