"""Draw the results table as one picture (`docs/images/results.png`) from a `dspark eval` report.

Per prompt set (and their mean): the speedup of the draft alone and of prompt lookup + the draft, over plain
decoding on the same kernels and over stock `generate()`, with a dashed line at 1.0. The report needs both ways
of the draft, which `dspark eval --lookup off on` times:

    dspark eval --limit 8 --max-new-tokens 96 --temperatures 0 1 --lookup off on --output <folder>
    python scripts/results_plot.py <folder>            # writes docs/images/results.png

Without a folder it takes the newest report under `docs/results/` and `research/` that has both. The title
names the draft, the machine and the date the report records (older reports record neither machine nor date:
pass `--machine` and `--date`). The drawing is `dspark_hf.evaluation.plots.plot_speedup_by_set`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dspark_hf.evaluation.plots import plot_speedup_by_set, speedup_by_set
from dspark_hf.evaluation.report import EvalReport

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "images" / "results.png"
SEARCHED = ("docs/results", "research")
#: the docs keep the picture small
MAX_BYTES = 200_000


def load_report(path: Path) -> EvalReport:
    """The report in `path`: a report folder or its `results.json`."""
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"no dspark eval report at {path} (expected a folder with results.json)")
    return EvalReport.from_json(json.loads(file.read_text(encoding="utf-8")))


def report_date(report: EvalReport, file: Path) -> str:
    """The date the report records, else the date its file was last committed, else '' (sorts first)."""
    if report.config.get("date"):
        return report.config["date"]
    log = subprocess.run(
        ["git", "log", "-1", "--format=%cs", "--", str(file)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return log.stdout.strip()


def newest_report(temperature: str) -> Path:
    """The newest report under `SEARCHED` that has a draft both without and with prompt lookup."""
    found = []
    for folder in SEARCHED:
        for file in sorted((REPO_ROOT / folder).rglob("results.json")):
            try:
                report = load_report(file)
                speedup_by_set(report, temperature=temperature)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                continue
            found.append((report_date(report, file), str(file)))
    if not found:
        raise SystemExit(
            f"no report under {', '.join(SEARCHED)} has the draft both without and with prompt lookup at "
            f"T={temperature}: run `dspark eval --lookup off on --output <folder>` and pass the folder"
        )
    return Path(max(found)[1]).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, nargs="?", help="a dspark eval report folder (default: the newest found)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the PNG")
    parser.add_argument("--temperature", default="0", help="the report's temperature to plot (default: 0)")
    parser.add_argument("--alone", help="the method of the draft alone (default: the one run with --lookup off)")
    parser.add_argument("--with-lookup", help="the method of lookup + draft (default: the one run with --lookup on)")
    parser.add_argument("--draft", help="the draft's name in the title (default: where the report says it came from)")
    parser.add_argument("--machine", help="the machine in the title (default: the one the report records)")
    parser.add_argument("--date", help="the date in the title (default: the one the report records)")
    args = parser.parse_args(argv)

    folder = args.report or newest_report(args.temperature)
    report = load_report(folder)
    try:
        path = plot_speedup_by_set(
            report,
            args.output,
            alone=args.alone,
            with_lookup=args.with_lookup,
            temperature=args.temperature,
            draft=args.draft,
            machine=args.machine,
            date=args.date or (None if report.config.get("date") else report_date(report, folder / "results.json")),
        )
    except ValueError as err:
        raise SystemExit(f"{folder}: {err}") from None
    size = path.stat().st_size
    print(f"plotted {folder}; wrote {path} ({size // 1024} KB)")
    if size > MAX_BYTES:
        print(f"warning: {path} is over {MAX_BYTES // 1000} KB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
