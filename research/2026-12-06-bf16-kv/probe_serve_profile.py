"""`dspark serve` with the target in bf16 (policy argv[1]: none or default) under the C = 32 level of
bench_vs_vllm.py (64 held-out prompts, 96 tokens, after a two-request warm-up), sampled by py-spy
(`pip install py-spy`, 40 Hz); prints tokens/s and the leaf functions with the most samples.
Usage, from the repository root: python research/2026-12-06-bf16-kv/probe_serve_profile.py none"""
import argparse, asyncio, subprocess, sys, tempfile, time
from collections import Counter
from pathlib import Path

sys.path.insert(0, "benchmarks")
from bench_serve import load_level, start_server, stop_servers
from bench_vs_vllm import load_prompts, served_model

tmp = Path(tempfile.mkdtemp())
args = argparse.Namespace(concurrency=[32], threads=2, max_tokens=96, kernels=None, target=None, draft=None,
                          dtype="bfloat16", device=None)
proc, url = start_server(sys.argv[1], args, tmp / "server.log")
try:
    prompts = load_prompts(Path("examples/default_drafts/heldout_own.jsonl"))
    extra = {"ignore_eos": True, "model": served_model(url)}
    asyncio.run(load_level(url, 1, 2, 96, prompts, extra))
    spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-r", "40", "-f", "raw", "-o", str(tmp / "spy.txt"),
                            "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    res = asyncio.run(load_level(url, 32, 64, 96, prompts, extra))
    spy.send_signal(2)
    spy.wait()
    print(f"{res['tokens_per_second']:.1f} tokens/s over {res['seconds']:.1f} s")
finally:
    stop_servers([proc])
leaves, total = Counter(), 0
for line in (tmp / "spy.txt").read_text().splitlines():
    stack, _, count = line.rpartition(" ")
    leaves[stack.split(";")[-1]] += int(count)
    total += int(count)
for leaf, n in leaves.most_common(15):
    print(f"{100 * n / total:5.1f}%  {leaf}")
