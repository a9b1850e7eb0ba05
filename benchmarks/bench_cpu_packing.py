"""What packed CPU linears (`dspark_hf.kernels.packed`) change: the verification cost curve and plain decoding.

Three measurements on the default target (SmolLM2-135M-Instruct, fp32), stock kernels vs packed weights,
interleaved within every repeat so both see the same machine load; medians over repeats:

1. `linear`: one `nn.Linear` of the target's shapes (576→1536 MLP, 1536→576, 576→49,152 LM head) at
   `M` rows, stock `F.linear` vs packed (for each `--hints` value of the packing's batch-size hint).
2. `forward`: the target's forward over `B` new tokens on a 256-token KV cache (the SPS curve the
   hardware-aware scheduler uses), stock vs packed; `B / B=1` is the cost of verifying B tokens relative
   to one decoding step.
3. `decode`: plain greedy `generate()` tokens/s, stock vs packed, on three chat prompts (so the packed
   kernels' own share of any speculative speedup is visible).

Usage:
    python benchmarks/bench_cpu_packing.py [--repeats 5] [--threads 2] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark_hf.default_model import chat_inputs, load_default_target
from dspark_hf.kernels import packed as cpu_packing
from dspark_hf.kernels.packed import packed_linears

PROMPTS = ["Explain why the sky is blue.", "Write a Python function that reverses a string.", "What is 17 times 23?"]
SHAPES = {"mlp_up 576→1536": (1536, 576), "mlp_down 1536→576": (576, 1536), "lm_head 576→49152": (49152, 576)}


def _median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bench_linear(rows: list[int], hints: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    out = {}
    for name, (n_out, n_in) in SHAPES.items():
        weight = torch.randn(n_out, n_in) * 0.02
        packed = {h: torch.ops.mkldnn._reorder_linear_weight(weight, h) for h in hints}
        reps = 20 if n_out > 10_000 else 200
        res = {}
        for m in rows:
            x = torch.randn(m, n_in)
            samples = {"stock": []} | {f"packed_h{h}": [] for h in hints}
            for _ in range(repeats):  # interleaved
                samples["stock"].append(_median_us(lambda x=x, w=weight: F.linear(x, w), reps))
                for h in hints:
                    pointwise = torch.ops.mkldnn._linear_pointwise
                    samples[f"packed_h{h}"].append(
                        _median_us(lambda x=x, w=packed[h], f=pointwise: f(x, w, None, "none", [], ""), reps)
                    )
            res[m] = {k: statistics.median(v) for k, v in samples.items()}
        out[name] = res
        print(name, {m: {k: round(v, 1) for k, v in r.items()} for m, r in res.items()}, flush=True)
    return out


def bench_forward(target, counts: list[int], repeats: int, context: int = 256) -> dict:
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prompt, cache=cache, use_cache=True)
    samples = {mode: {b: [] for b in counts} for mode in ("stock", "packed")}
    for _ in range(repeats):
        for b in counts:
            ids = torch.randint(0, vocab, (1, b), generator=gen)
            pos = torch.arange(context, context + b)[None]
            for mode in samples:
                with torch.no_grad(), packed_linears(target, enabled=mode == "packed"):
                    target(ids, position_ids=pos, cache=cache, use_cache=True)  # warm
                    cache.crop(-b)
                    start = time.perf_counter()
                    target(ids, position_ids=pos, cache=cache, use_cache=True)
                    samples[mode][b].append(time.perf_counter() - start)
                    cache.crop(-b)
    res = {mode: {b: statistics.median(v) * 1e3 for b, v in per.items()} for mode, per in samples.items()}
    for mode, per in res.items():
        print(f"forward {mode}: " + ", ".join(f"B={b} {ms:.1f} ms" for b, ms in per.items()), flush=True)
    return res


def bench_decode(target, tokenizer, repeats: int, max_new_tokens: int) -> dict:
    samples = {"stock": [], "packed": []}
    for _ in range(repeats):
        for mode in samples:
            tokens = seconds = 0.0
            for prompt in PROMPTS:
                inputs = chat_inputs(tokenizer, prompt)
                with torch.no_grad(), packed_linears(target, enabled=mode == "packed"):
                    start = time.perf_counter()
                    out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
                    seconds += time.perf_counter() - start
                tokens += out.shape[1] - inputs["input_ids"].shape[1]
            samples[mode].append(tokens / seconds)
    res = {mode: statistics.median(v) for mode, v in samples.items()}
    print(f"plain decoding: stock {res['stock']:.1f} tok/s, packed {res['packed']:.1f} tok/s", flush=True)
    return res


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fwd = result["forward"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, style in (("stock", "o-"), ("packed", "s-")):
        xs = sorted(fwd[mode], key=int)
        ax.plot([int(b) for b in xs], [fwd[mode][b] for b in xs], style, label=f"{mode} kernels")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the forward (B)")
    ax.set_ylabel("ms per forward")
    ax.set_ylim(bottom=0)
    ax.set_title("SmolLM2-135M forward on a 256-token cache, CPU", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--hints", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "pack_batch_hint_in_use": cpu_packing.PACK_BATCH_HINT,
        "linear_us": bench_linear(args.rows, args.hints, args.repeats),
        "forward": bench_forward(target, args.counts, args.repeats),
        "decode_tokens_per_s": bench_decode(target, tokenizer, max(1, args.repeats // 2), args.max_new_tokens),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_packing.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "cpu_packing.png")
    print(f"wrote {out / 'cpu_packing.json'} and {out / 'cpu_packing.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
