"""Load generator for `dspark serve`: tokens/s, TTFT and inter-token latency vs concurrency, speculation on vs off.

One `dspark serve` subprocess per mode (by default: the default verification policy, and `--policy none`, plain
batched decoding through the same engine), all on 127.0.0.1 and all loaded before measuring; a server waits
idle while another is measured. For every repeat and every concurrency C, each mode is loaded in turn (the
order rotates between repeats, so that every mode takes every position) and warmed by one short request: C clients each send streaming chat requests back to back (greedy,
`max_tokens` fixed) until `--requests` requests (at least C) are done. Per level it records aggregate completion
tokens/s (all tokens / wall time), time to first token and inter-token latency (the gap between two streamed
chunks split over the tokens the later one carries, as the server's own histogram does) per token.

    python benchmarks/bench_serve.py --max-tokens 32 --repeats 3
    python benchmarks/bench_serve.py --policies default none none@stock   # plus plain decoding on stock kernels

A mode `POLICY@KERNELS` runs its server with `--kernels KERNELS`; without one, each server runs its default
kernels (exact for the float32 default target on a CPU). `POLICY+lookup-off` (or `-on`) sets the server's
`--lookup` (without it, the draft's own setting: on for the shipped drafts), e.g. `default+lookup-off`. A `#TAG` suffix starts one more server of the same
configuration: `none#2` is a second server without speculation, measured like the others, so its ratio to
`none` (1.00 on a quiet machine) is the benchmark's own resolution on this host (the A/A control):

    python benchmarks/bench_serve.py --policies default none none#2 --max-tokens 24 --repeats 5 --requests 16
 The table gives each mode's ratio to `none` three ways: the
ratio of the medians, the median of the per-repeat ratios (each pair measured back to back), and the geometric
mean of those paired ratios with its 95% interval (Student t over their logarithms: an interval that holds 1.00
means the run cannot tell that mode from `none`). It also gives the share of each mode's rounds at that level
that drafted and that copied (prompt lookup), from the server's `/metrics` counters read around each level.

Writes `benchmarks/results/serve.json` (every repeat, and medians) and prints a markdown table. Traffic goes to
127.0.0.1 only; every request loop is bounded by `--requests`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning a new language.",
    "What is the capital of France, and what is it known for?",
    "Summarise the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "What are the benefits of regular exercise?",
    "Describe a sunset to someone who has never seen one.",
    "What is 17 times 23? Show your working.",
    "Write a short poem about autumn leaves.",
    "What causes the seasons on Earth?",
    "List five fruits that are high in vitamin C.",
    "How does a refrigerator keep food cold?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_mode(mode: str) -> tuple[str | None, str | None, str | None]:
    """`"policy+lookup-MODE@kernels#tag"` -> (policy or None for the server's default, kernels or None for the
    default, lookup `"on"`/`"off"` or None for the draft's own setting).

    The `#tag` only names a second server of the same configuration (`none#2`: the A/A control)."""
    policy, _, kernels = mode.partition("#")[0].partition("@")
    policy, _, lookup = policy.partition("+lookup-")
    return (None if policy == "default" else policy), (kernels or None), (lookup or None)


def start_server(mode: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    policy, kernels, lookup = split_mode(mode)
    port = _free_port()
    argv = [sys.executable, "-m", "dspark_hf.cli", "serve", "--port", str(port), "--log-level", "warning"]
    argv += ["--max-batch-size", str(max(args.concurrency)), "--max-queue", str(2 * max(args.concurrency))]
    argv += ["--threads", str(args.threads), "--max-new-tokens", str(args.max_tokens)]
    if policy is not None:
        argv += ["--policy", policy]
    if kernels or args.kernels:
        argv += ["--kernels", kernels or args.kernels]
    if lookup:
        argv += ["--lookup", lookup]
    if getattr(args, "prefix_cache_mib", None) is not None:
        argv += ["--prefix-cache-mib", str(args.prefix_cache_mib)]
    for flag in ("target", "draft", "dtype", "device"):
        if getattr(args, flag):
            argv += [f"--{flag}", getattr(args, flag)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url + "/ready", log, mode)
    return proc, url


def wait_ready(proc: subprocess.Popen, ready_url: str, log: Path, name: str, seconds: float = 600) -> None:
    """Poll `ready_url` until it answers 200 (bounded: `seconds`, 10 minutes by default: the first hardware-aware
    start measures the SPS profile); exit with the log's tail if the server dies or never gets ready."""
    for _ in range(int(seconds / 0.2)):
        if proc.poll() is not None:
            raise SystemExit(f"server for mode {name} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server for mode {name} never became ready")


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every server still running, then wait up to a minute for each and kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def one_request(client, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One greedy streaming chat request; `extra` adds body fields (e.g. `ignore_eos`, `model`)."""
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens}
    body.update(stream=True, return_token_ids=True, **(extra or {}))
    sent = time.perf_counter()
    arrivals = []  # (time, tokens in the chunk)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n = sum(len(c.get("token_ids", [])) for c in chunk.get("choices", []))
            if n:
                arrivals.append((time.perf_counter(), n))
    ttft = arrivals[0][0] - sent if arrivals else float("nan")
    gaps = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        gaps += [(t1 - t0) / n] * n
    gaps += [0.0] * (arrivals[0][1] - 1 if arrivals else 0)  # tokens that came with the first one
    return {"ttft": ttft, "itl": gaps, "tokens": sum(n for _, n in arrivals)}


def eval_prompts(per_set: int = 4) -> list[str]:
    """The first `per_set` prompts of each evaluation set (GSM8K, HumanEval, MT-Bench, ShareGPT held-out; offline,
    as `dspark eval` loads them), interleaved: longer, more varied traffic than the short chat prompts."""
    from dspark_hf.evaluation.prompt_sets import EVAL_SETS, load_prompt_set

    sets = [[item.prompt for item in load_prompt_set(name, limit=per_set)] for name in EVAL_SETS]
    return [prompts[i] for i in range(per_set) for prompts in sets]


async def load_level(url: str, concurrency: int, requests: int, max_tokens: int, prompts=None, extra=None) -> dict:
    counter = iter(range(requests))
    prompts = prompts or PROMPTS

    async def client_loop(client, results):
        for i in counter:  # shared iterator: each request index is taken by exactly one client
            results.append(await one_request(client, prompts[i % len(prompts)], max_tokens, extra))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        results: list[dict] = []
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, results) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(g for r in results for g in r["itl"])
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "itl_p50": _pct(itl, 50),
        "itl_p99": _pct(itl, 99),
    }


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


COUNTERS = ("rounds_total", "drafting_rounds_total", "lookup_rounds_total")


def engine_metrics(url: str, names) -> dict:
    """The server's `dspark_engine_NAME` values now (`/metrics`), for each of `names` it exposes."""
    wanted = {f"dspark_engine_{name}": name for name in names}
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        key, _, value = line.partition(" ")
        if key in wanted:
            out[wanted[key]] = float(value.split()[-1])
    return out


def engine_summary(url: str) -> dict:
    out = {"kernels": httpx.get(url + "/ready", timeout=60).json().get("kernels")}
    return {**out, **engine_metrics(url, ("tau", "mean_verification_length", *COUNTERS))}


def _medians(samples: dict) -> dict:
    """Per concurrency and mode, the median over repeats of every measurement (levels without data skipped)."""
    out = {}
    for c, per_mode in samples.items():
        if all(per_mode.values()):
            out[c] = {m: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for m, runs in per_mode.items()}
    return out


def paired_ratio(runs: list[dict], base: list[dict]) -> float:
    """Median over repeats of (tokens/s of a mode) / (tokens/s of the baseline in the same repeat): each pair
    was measured back to back, so a slow moment of the machine divides out instead of landing on one mode."""
    return statistics.median(r["tokens_per_second"] / b["tokens_per_second"] for r, b in zip(runs, base))


# two-sided 95% Student t quantiles by degrees of freedom (1-30); beyond 30, 2.0 is within 2% of the truth
_T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13]
_T95 += [2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04]


def paired_interval(runs: list[dict], base: list[dict]) -> tuple[float, float, float] | None:
    """Geometric mean of the paired ratios and its 95% interval (Student t over the log ratios), or `None`
    with fewer than two pairs. An interval that holds 1.0 means the run cannot tell the modes apart."""
    logs = [math.log(r["tokens_per_second"] / b["tokens_per_second"]) for r, b in zip(runs, base)]
    if len(logs) < 2:
        return None
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = (_T95[len(logs) - 2] if len(logs) - 1 <= len(_T95) else 2.0) * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def speculated_share(runs: list[dict]) -> str:
    """Rounds that drafted or copied over all rounds of a mode's runs at a level (`-` without counters)."""
    rounds = sum(r.get("rounds", 0) for r in runs)
    if not rounds:
        return "-"
    drafted = sum(r.get("drafting_rounds", 0) for r in runs)
    copied = sum(r.get("lookup_rounds", 0) for r in runs)
    return f"{drafted / rounds:.0%} / {copied / rounds:.0%}"


def render(report: dict) -> str:
    """The markdown table of a (possibly partial) report: medians, the ratio to `none` within the run (the ratio
    of the medians, the median of the repeats' paired ratios, their geometric mean with its 95% interval) and the
    share of rounds that drafted / copied (`-` for reports made before the counters were recorded)."""
    samples = {int(c): v for c, v in report["samples"].items()}
    medians = _medians(samples)
    modes = list(next(iter(samples.values())))
    lines = [
        "| C | mode | repeats | tokens/s | vs none | vs none, paired | paired: mean [95% interval] "
        "| rounds drafting / copying | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, per_mode in medians.items():
        for mode in modes:
            m = per_mode[mode]
            base = per_mode.get("none")
            ratio = f"{m['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "-"
            paired = f"{paired_ratio(samples[c][mode], samples[c]['none']):.2f}x" if base else "-"
            interval = paired_interval(samples[c][mode], samples[c]["none"]) if base and mode != "none" else None
            band = f"{interval[0]:.3f} [{interval[1]:.3f}, {interval[2]:.3f}]" if interval else "-"
            lines.append(
                f"| {c} | {mode} | {len(samples[c][mode])} | {m['tokens_per_second']:.1f} | {ratio} | {paired} | "
                f"{band} | {speculated_share(samples[c][mode])} | "
                f"{m['ttft_p50']:.2f} / {m['ttft_p99']:.2f} | {1000 * m['itl_p50']:.0f} / {1000 * m['itl_p99']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=None, help="draft (default: the shipped draft for the default target)")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["default", "none"],
        help="modes to compare: `default` (the server's default policy), `none` (no speculation), or any policy; "
        "`POLICY@KERNELS` runs that server on other kernels (e.g. none@stock)",
    )
    parser.add_argument(
        "--kernels", default=None, help="kernels of every server without an @KERNELS (default: the server's own)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--requests", type=int, default=4, help="requests per level (at least the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--prompts",
        choices=("chat", "eval"),
        default="chat",
        help="chat: 16 short chat prompts (the default); eval: the first 4 prompts of each evaluation set "
        "(GSM8K, HumanEval, MT-Bench, ShareGPT), interleaved",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="benchmarks/results/serve.json")
    parser.add_argument("--render", default=None, help="only print the table of an existing (partial) JSON report")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    servers = {}
    logs = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    print(f"server logs in {logs}", flush=True)
    report = {
        "command": "python " + " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "modes": args.policies,
        "kernels": args.kernels,
        "complete": False,
    }
    prompts = eval_prompts() if args.prompts == "eval" else PROMPTS
    try:
        for mode in args.policies:
            log = logs / f"serve_{mode.replace(':', '_').replace('@', '_').replace('#', '_')}.log"
            servers[mode] = start_server(mode, args, log)
            print(f"started {mode} at {servers[mode][1]}", flush=True)
        for _, url in servers.values():  # warm-up: one short request each
            asyncio.run(load_level(url, 1, 1, 4))
        samples = {c: {m: [] for m in servers} for c in args.concurrency}
        for rep in range(args.repeats):
            for c in args.concurrency:
                # each mode takes every position in turn (with two modes: the order alternates); a fixed
                # middle position for the baseline, as reversing three modes gave, is a bias of its own
                shift = (rep + c) % len(servers)
                order = list(servers)[shift:] + list(servers)[:shift]
                for mode in order:
                    # one short request first: the server that waited idle while another was measured starts
                    # with cold caches and parked OpenMP threads, which the first measured mode of a pair paid
                    asyncio.run(load_level(servers[mode][1], 1, 1, 4))
                    before = engine_metrics(servers[mode][1], COUNTERS)
                    res = asyncio.run(load_level(servers[mode][1], c, max(c, args.requests), args.max_tokens, prompts))
                    after = engine_metrics(servers[mode][1], COUNTERS)
                    for name in COUNTERS:  # this level's rounds, and how many of them drafted or copied
                        res[name.removesuffix("_total")] = after.get(name, 0.0) - before.get(name, 0.0)
                    samples[c][mode].append(res)
                    print(f"repeat {rep} C={c:2d} {mode:>10}: {res['tokens_per_second']:6.1f} tok/s", flush=True)
                    out.write_text(json.dumps({**report, "samples": samples}, indent=1))  # partial results
        engines = {mode: engine_summary(url) for mode, (_, url) in servers.items()}
    finally:
        stop_servers([proc for proc, _ in servers.values()])

    medians = _medians(samples)
    report.update(complete=True, engine=engines, medians=medians, samples=samples)
    out.write_text(json.dumps(report, indent=1))
    print(render(report))
    print(f"\nengine totals per mode: {engines}\nwrote {out}")


if __name__ == "__main__":
    main()
