"""The serve benchmark's statistics: the paired ratio's interval and the share of rounds that speculated."""

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("httpx")
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"
_SPEC = importlib.util.spec_from_file_location("bench_serve", _PATH)
bench_serve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_serve)


def _runs(rates):
    return [{"tokens_per_second": r} for r in rates]


def test_the_paired_interval_is_a_t_interval_over_log_ratios():
    base = _runs([100.0, 100.0, 100.0])
    mean, low, high = bench_serve.paired_interval(_runs([110.0, 100.0, 120.0]), base)
    logs = [math.log(1.1), 0.0, math.log(1.2)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    assert mean == pytest.approx(math.exp(m))
    assert low == pytest.approx(math.exp(m - 4.30 * sd / math.sqrt(3)))
    assert high == pytest.approx(math.exp(m + 4.30 * sd / math.sqrt(3)))


def test_a_steady_gain_excludes_one_and_scatter_around_one_holds_it():
    base = _runs([100.0, 90.0, 110.0, 95.0, 105.0, 100.0])
    steady = bench_serve.paired_interval(_runs([112.0, 101.0, 123.0, 106.0, 118.0, 111.0]), base)
    assert steady[1] > 1.0
    noisy = bench_serve.paired_interval(_runs([103.0, 88.0, 112.0, 93.0, 104.0, 101.0]), base)
    assert noisy[1] < 1.0 < noisy[2]
    assert bench_serve.paired_interval(_runs([100.0]), _runs([100.0])) is None


def test_the_speculated_share_counts_drafting_and_copy_rounds():
    runs = [{"rounds": 80, "drafting_rounds": 4, "lookup_rounds": 20}, {"rounds": 20, "drafting_rounds": 1}]
    assert bench_serve.speculated_share(runs) == "5% / 20%"
    assert bench_serve.speculated_share(_runs([1.0])) == "-"


def test_the_counters_are_read_from_the_engines_own_exposition(monkeypatch):
    from dspark_hf.decoding.metrics import EngineMetrics

    metrics = EngineMetrics(block_size=4)
    metrics.rounds, metrics.drafting_rounds, metrics.lookup_rounds = 40, 3, 7
    text = "# HELP other\nother_total 5\n" + metrics.to_prometheus()

    class Reply:
        def __init__(self, body):
            self.text = body

    monkeypatch.setattr(bench_serve.httpx, "get", lambda url, timeout: Reply(text))
    values = bench_serve.engine_metrics("http://127.0.0.1:1", bench_serve.COUNTERS)
    assert values == {"rounds_total": 40.0, "drafting_rounds_total": 3.0, "lookup_rounds_total": 7.0}
