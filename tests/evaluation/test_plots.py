"""The summary plot of an evaluation (`plot_speedup_by_set`, drawn by `scripts/results_plot.py` for the docs) on a
tiny hand-made report whose speedups are known."""

from __future__ import annotations

import math

import pytest

from dspark_hf.evaluation.methods import PLAIN, PLAIN_EXACT
from dspark_hf.evaluation.plots import lookup_methods, plot_report, plot_speedup_by_set, speedup_by_set
from dspark_hf.evaluation.report import EvalReport, PromptRun

pytest.importorskip("matplotlib")

ALONE, LOOKUP = "d@lookup-off", "d@lookup-on"
#: seconds for 10 new tokens on every prompt: plain stock 2 s, plain on the exact kernels 1 s, the draft alone
#: 0.8 s, lookup + draft 0.5 s
SECONDS = {PLAIN: 2.0, PLAIN_EXACT: 1.0, ALONE: 0.8, LOOKUP: 0.5}


def _report(lookup=None, kernels: str = "exact") -> EvalReport:
    methods = {PLAIN: {"kind": "plain"}, PLAIN_EXACT: {"kind": "plain_exact", "kernels": "exact"}}
    methods |= {m: {"kind": "draft", "block_size": 3, "source": "tiny draft"} for m in (ALONE, LOOKUP)}
    if kernels == "stock":
        del methods[PLAIN_EXACT]
    runs = [
        PromptRun(s, "p", 0.0, m, [SECONDS[m]], [1] * 10, "x", [(2, 1)] * 5 if m in (ALONE, LOOKUP) else [])
        for s in ("gsm8k", "own-code")
        for m in methods
    ]
    lookup = {ALONE: False, LOOKUP: True} if lookup is None else lookup
    config = {"kernels": kernels, "lookup": lookup, "sets": {"gsm8k": 1, "own-code": 1}, "machine": "a test box"}
    return EvalReport({**config, "date": "2026-01-02"}, methods, runs)


def test_speedup_by_set_draws_the_table():
    groups, bars = speedup_by_set(_report())
    assert groups == ["gsm8k", "own-code", "mean of sets"]
    figures = {name: ys for name, ys, _ in bars}
    assert list(figures) == [
        "draft alone, over plain decoding on the same (exact) kernels",
        "lookup + draft, over plain decoding on the same (exact) kernels",
        "draft alone, over stock generate()",
        "lookup + draft, over stock generate()",
    ]
    expected = [1.25, 2.0, 2.5, 4.0]  # 1 / 0.8, 1 / 0.5, 2 / 0.8, 2 / 0.5
    for ys, x in zip(figures.values(), expected):
        assert ys == pytest.approx([x, x, x])


def test_speedup_by_set_on_stock_kernels_draws_each_speedup_once():
    _, bars = speedup_by_set(_report(kernels="stock"))
    assert [name for name, _, _ in bars] == [
        "draft alone, over stock generate()",
        "lookup + draft, over stock generate()",
    ]


def test_plot_speedup_by_set_writes_a_png(tmp_path):
    path = plot_speedup_by_set(_report(), tmp_path / "images" / "results.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 200_000


def test_plot_report_speedup_panel_still_draws(tmp_path):
    """plot_report's per-temperature speedup panel shares the bar drawing."""
    files = plot_report(_report(), tmp_path)
    assert (tmp_path / "speedup.png") in files and (tmp_path / "speedup.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("lookup", "message"),
    [
        (None, None),
        (True, "no draft that ran without prompt lookup"),  # `--lookup on` for both: nothing alone
        ({ALONE: None, LOOKUP: True}, "no draft that ran without prompt lookup"),  # the draft's own default: unknown
        ({ALONE: False, LOOKUP: False}, "Several drafts ran without prompt lookup"),
    ],
)
def test_speedup_by_set_says_what_is_missing(lookup, message):
    report = _report(lookup)
    if message is None:
        assert lookup_methods(report) == {False: [ALONE], True: [LOOKUP]}
        speedup_by_set(report)
        return
    with pytest.raises(ValueError, match=message):
        speedup_by_set(report)
    if isinstance(lookup, dict) and lookup[ALONE] is False:  # naming the methods settles it
        groups, bars = speedup_by_set(report, alone=ALONE, with_lookup=LOOKUP)
        assert not any(math.isnan(y) for _, ys, _ in bars for y in ys)


def test_a_new_report_records_the_machine_and_the_date():
    """What the plot's title names comes with every new report (older reports lack it: the script asks for it)."""
    import datetime
    import os
    from types import SimpleNamespace

    import torch

    from dspark_hf.evaluation.harness import _run_config

    target = torch.nn.Linear(1, 1)
    target.config, target.device = SimpleNamespace(name_or_path="tiny"), torch.device("cpu")
    config = _run_config(target, {"gsm8k": [None]}, [0.0], {})
    assert config["date"] == datetime.date.today().isoformat()
    assert config["machine"].startswith(f"{os.cpu_count()}-core ")


def test_the_results_plot_script(tmp_path, capsys):
    """`scripts/results_plot.py FOLDER` draws a saved report, and names what a report without the draft alone lacks."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "results_plot.py"
    spec = importlib.util.spec_from_file_location("results_plot", script)
    results_plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_plot)

    _report().save(tmp_path / "eval", plots=False)
    assert results_plot.main([str(tmp_path / "eval"), "--output", str(tmp_path / "results.png")]) == 0
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert "results.png" in capsys.readouterr().out

    _report(lookup=True).save(tmp_path / "lookup-only", plots=False)
    with pytest.raises(SystemExit, match="no draft that ran without prompt lookup.*--lookup off on"):
        results_plot.main([str(tmp_path / "lookup-only"), "--output", str(tmp_path / "none.png")])


def test_the_readme_table_script(tmp_path, capsys):
    """`scripts/readme_table.py FOLDER` prints one row per set and the macro row, with the speedups the report's
    times give: the draft alone 1.25× and with lookup 2.0× the same kernels, 2.5× and 4.0× stock."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "readme_table.py"
    spec = importlib.util.spec_from_file_location("readme_table", script)
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)

    def table(folder):
        readme_table.main([str(folder)])
        return [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line[:2] == "| "][1:]

    _report().save(tmp_path / "eval", plots=False)
    rows = table(tmp_path / "eval")
    assert [row[0] for row in rows] == ["gsm8k", "own-code", "**macro, evaluation sets**"]
    for row in rows:  # no greedy-identity record in this report: said, not assumed
        assert row[3:9] == ["1.25×", "2.00×", "2.00×", "2.50×", "4.00×", "–"], row

    import json

    results = tmp_path / "eval" / "results.json"
    report = json.loads(results.read_text())
    record = {"gsm8k": {ALONE: 1.0, LOOKUP: 1.0}, "own-code": {ALONE: 1.0, LOOKUP: 0.875}}
    report["quality"] = {
        "greedy_identity": {s: {m: {"exact_match": v} for m, v in r.items()} for s, r in record.items()}
    }
    results.write_text(json.dumps(report))
    assert [row[-1] for row in table(tmp_path / "eval")] == ["yes", "NO", "NO"]
