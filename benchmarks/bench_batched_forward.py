"""One batched target forward, stock vs exact kernels: what a round of the batched engine costs.

On the real default target (SmolLM2-135M-Instruct, fp32, offline): a chat prompt is prefilled for `R` rows,
then one forward over `R` rows × `L` new tokens on that cache is timed (the shape of an engine round: `L = 1`
without drafts, `1 + drafts` when verifying), and the new tokens are cropped off again. Kernel modes and shapes
are interleaved in every repeat; a figure is the median over repeats of the median of `--steps` forwards.
(That the exact mode's rows are identical to one-row decoding is checked by tests/decoding/test_engine_exact.py.)
`--prefill` times one prompt's prefill of 64 … 2048 tokens in one forward instead (the exact mode runs its kernels at
every length).

    python benchmarks/bench_batched_forward.py --repeats 3 --threads 2 --out benchmarks/results/batched_forward.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _report import write_report
from transformers import DynamicCache

from dspark_hf import kernels
from dspark_hf.default_model import chat_inputs, load_default_target

PROMPT = "Why is the sky blue? Explain in detail with physics."
SHAPES = ((1, 1), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1), (1, 4), (4, 4), (8, 4), (16, 4))
PREFILLS = (64, 128, 256, 512, 1024, 2048)
MODES = ("stock", "exact")


@torch.inference_mode()
def round_ms(target, ids, rows: int, new: int, mode: str, steps: int) -> float:
    with kernels.use_kernels(target, mode=mode):
        cache = DynamicCache(config=target.config)
        out = target(input_ids=ids.repeat(rows, 1), cache=cache, use_cache=True)
        tokens = out.logits[:, -1:].argmax(-1).repeat(1, new)
        times = []
        for i in range(steps + 1):
            start = time.perf_counter()
            target(input_ids=tokens, cache=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            cache.crop(-new)
            if i:  # one warm-up forward
                times.append(elapsed)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def prefill_ms(target, length: int, mode: str, steps: int) -> float:
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(length))
    times = []
    with kernels.use_kernels(target, mode=mode):
        for _ in range(steps):
            start = time.perf_counter()
            target(input_ids=ids, cache=DynamicCache(config=target.config), use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed forwards per cell and repeat")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="time prefills of 64 … 2048 tokens instead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target()
    ids = chat_inputs(tokenizer, PROMPT)["input_ids"]
    cells = [str(n) for n in PREFILLS] if args.prefill else [f"{r}x{n}" for r, n in SHAPES]
    runs: dict[str, dict[str, list[float]]] = {m: {c: [] for c in cells} for m in MODES}
    for _ in range(args.repeats):
        for cell in cells:
            for mode in MODES:
                if args.prefill:
                    ms = prefill_ms(target, int(cell), mode, max(1, args.steps // 2))
                else:
                    rows, new = map(int, cell.split("x"))
                    ms = round_ms(target, ids, rows, new, mode, args.steps)
                runs[mode][cell].append(ms)
    table = {m: {c: statistics.median(v) for c, v in per.items()} for m, per in runs.items()}
    print(f"{'prefill tokens' if args.prefill else 'rows x new':>14}  {'stock ms':>9}  {'exact ms':>9}  stock/exact")
    for cell in cells:
        print(f"{cell:>14}  {table['stock'][cell]:9.1f}  {table['exact'][cell]:9.1f}  "
              f"{table['stock'][cell] / table['exact'][cell]:.2f}")  # fmt: skip
    if args.out:
        write_report(args.out, args, prompt=PROMPT, median_ms=table, runs_ms=runs)


if __name__ == "__main__":
    main()
