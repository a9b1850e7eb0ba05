"""The exact mode's lean paths against the same exact kernels called through transformers' layers.

On the real default target (SmolLM2-135M-Instruct, fp32, offline), one forward over 1, 4 and 8 new tokens on a
KV cache of a chat prompt: the exact mode as it runs by default (the base model's lean forward: all layers in
one compiled call, `dspark_hf.kernels`), the exact mode with lean layers called one by one (the base
model's own forward), the exact mode with the lean path switched off (transformers' own layer, attention and
MLP modules, whose linears and attention still run on the exact kernels), then stock kernels for reference. The
configurations and row counts are interleaved in every repeat; each figure is the median over repeats of the
median forward time within a repeat. (Batch invariance and agreement with the stock layers
are checked by tests/kernels/test_kernels.py, not here.)

    python benchmarks/bench_lean_layers.py --repeats 3 --threads 2 --out benchmarks/results/lean_layers.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _report import write_report
from transformers import DynamicCache

from dspark_hf.default_model import chat_inputs, load_default_target
from dspark_hf import kernels
from dspark_hf.kernels import exact as swaps

PROMPT = "Why is the sky blue? Explain in detail with physics."
ROWS = (1, 4, 8)
CONFIGS = ("exact (layer stack)", "exact (lean layers)", "exact (transformers layers)", "stock")


def forward_ms(target, ids, rows: int, config: str, steps: int) -> float:
    real, real_model = swaps.lean_eligible, swaps.lean_model_eligible
    if config == "exact (transformers layers)":
        swaps.lean_eligible = lambda module: False
    if config != "exact (layer stack)":
        swaps.lean_model_eligible = lambda module: False
    mode = "stock" if config == "stock" else "exact"
    try:
        with torch.inference_mode(), kernels.use_kernels(target, mode=mode):
            lean = any(kernels.is_lean(layer) for layer in target.model.layers)
            assert lean == config.startswith(("exact (lean", "exact (layer")), (config, lean)
            assert kernels.is_lean_model(target.model) == (config == "exact (layer stack)")
            cache = DynamicCache(config=target.config)
            out = target(input_ids=ids, cache=cache, use_cache=True)
            new = out.logits[:, -1:].argmax(-1).repeat(1, rows)
            times = []
            for i in range(steps + 2):
                start = time.perf_counter()
                target(input_ids=new, cache=cache, use_cache=True)
                elapsed = time.perf_counter() - start
                cache.crop(-rows)
                if i >= 2:  # two warm-up forwards
                    times.append(elapsed)
    finally:
        swaps.lean_eligible, swaps.lean_model_eligible = real, real_model
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed forwards per configuration and repeat")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    ids = chat_inputs(tokenizer, PROMPT)["input_ids"]
    runs: dict[str, dict[int, list[float]]] = {c: {r: [] for r in ROWS} for c in CONFIGS}
    for _ in range(args.repeats):
        for rows in ROWS:
            for config in CONFIGS:
                runs[config][rows].append(forward_ms(target, ids, rows, config, args.steps))
    table = {c: {r: statistics.median(v) for r, v in per.items()} for c, per in runs.items()}
    print(f"{'rows':>4}  " + "  ".join(f"{c:>28}" for c in CONFIGS) + "  stack / lean / transformers layers")
    for rows in ROWS:
        cells = "  ".join(f"{table[c][rows]:>25.1f} ms" for c in CONFIGS)
        layers = table["exact (transformers layers)"][rows]
        ratios = [layers / table[c][rows] for c in CONFIGS[:2]]
        print(f"{rows:>4}  {cells}  " + " / ".join(f"{r:.2f}x" for r in ratios) + " / 1.00x")
    if args.out:
        write_report(args.out, args, prompt=PROMPT, median_ms=table, runs_ms=runs)


if __name__ == "__main__":
    main()
