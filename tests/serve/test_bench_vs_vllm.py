"""The vLLM comparison's bookkeeping (no server, no vLLM): requests per level, medians over repeats, the tables."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("httpx")
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_vllm.py"
_SPEC = importlib.util.spec_from_file_location("bench_vs_vllm", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _level(rate, ttft=0.5, itl=0.02):
    return {"tokens_per_second": rate, "ttft_p50": ttft, "ttft_p99": 2 * ttft, "itl_p50": itl, "itl_p99": 2 * itl}


def test_requests_per_level_is_at_least_the_concurrency():
    assert bench.requests_per_level(1, None) == 8
    assert bench.requests_per_level(16, None) == 32
    assert bench.requests_per_level(4, 2) == 4
    assert bench.requests_per_level(4, 10) == 10


def test_medians_per_mode_and_level():
    samples = {"dspark": {"1": [_level(10.0), _level(30.0), _level(20.0)]}, "vllm-fp32": {"1": [], "2": [_level(5)]}}
    med = bench.medians(samples)
    assert med["dspark"]["1"]["tokens_per_second"] == 20.0
    assert list(med["vllm-fp32"]) == ["2"]


def test_render_has_one_row_per_mode_and_one_column_per_level(tmp_path):
    samples = {"vllm-fp32": {"1": [_level(40.0)], "2": [_level(70.0)]}, "dspark": {"1": [_level(50.0)]}}
    report = {
        "cpu": "Some CPU",
        "cpu_count": 2,
        "threads": 2,
        "prompt_count": 64,
        "prompt_tokens": {"min": 35, "median": 100, "max": 574, "count": 64},
        "max_tokens": 96,
        "repeats": 1,
        "command": "python benchmarks/bench_vs_vllm.py",
        "samples": samples,
    }
    text = bench.render(json.loads(json.dumps(report)))
    assert "35-574 tokens" in text and "Some CPU" in text
    assert "| mode | C = 1 | C = 2 |" in text
    assert "| vllm-fp32 | 40.0 | 70.0 |" in text
    assert "| dspark | 50.0 | - |" in text
    assert "| dspark | 500 / 1000 | - |" not in text and "| dspark | 0.50 / 1.00 | - |" in text
    assert "| vllm-fp32 | 20 / 40 | 20 / 40 |" in text


def test_load_prompts_reads_the_prompt_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "one"}\n\n{"id": "b", "prompt": "two"}\n', encoding="utf-8")
    assert bench.load_prompts(path) == ["one", "two"]
    assert bench.load_prompts(path, limit=1) == ["one"]


@pytest.mark.parametrize("cache", ["reset", "kept", "off"])
def test_prefix_cache_modes_reach_the_vllm_server(tmp_path, monkeypatch, cache):
    # reset: the dev-mode endpoint that empties the cache is served; off: prefix caching disabled; kept: neither
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").touch()
    started = {}

    def popen(argv, env, **kwargs):
        started.update(argv=argv, env=env)
        return object()

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    monkeypatch.setattr(bench, "wait_ready", lambda *args, **kwargs: None)
    args = bench.argparse.Namespace(
        vllm_venv=str(venv), target="T", threads=2, concurrency=[1, 32], vllm_kvcache_gib=2, vllm_preload="none",
        prefix_cache=cache,
    )  # fmt: skip
    bench.start_vllm("vllm-bf16", args, tmp_path / "log")
    assert ("--no-enable-prefix-caching" in started["argv"]) == (cache == "off")
    assert (started["env"].get("VLLM_SERVER_DEV_MODE") == "1") == (cache == "reset")


@pytest.mark.parametrize("mib", [None, 0])
def test_our_server_gets_the_prefix_cache_size(tmp_path, monkeypatch, mib):
    # --prefix-cache off starts our server with --prefix-cache-mib 0; otherwise the server's own default
    serve = bench.sys.modules["bench_serve"]
    started = {}

    def popen(argv, env, **kwargs):
        started.update(argv=argv)
        return object()

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve, "wait_ready", lambda *args, **kwargs: None)
    args = bench.argparse.Namespace(
        concurrency=[1, 32], threads=2, max_tokens=96, kernels=None, target=None, draft=None, dtype=None,
        device=None, prefix_cache_mib=mib,
    )  # fmt: skip
    bench.start_server("default", args, tmp_path / "log")
    argv = started["argv"]
    assert ("--prefix-cache-mib" in argv) == (mib is not None)
    if mib is not None:
        assert argv[argv.index("--prefix-cache-mib") + 1] == "0"
