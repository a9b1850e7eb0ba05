"""The exact mode's linear kernel against its predecessor and the stock kernels, by row count (issue 52).

T(k), the time of one `x @ W.T` with k rows, on SmolLM2-135M's linear shapes (q/o 576x576, k/v 192x576, gate/up
1536x576, down 576x1536, the LM head 49152x576) for k in 1, 2, 4, 8, 16, 64, 256, 512:

* `exact`: the exact mode's kernel as built now (`dspark_hf.kernels.build.backend().linear`);
* `old exact`: the same function compiled from an earlier revision's `exact_kernels.cpp` (`--baseline`, by default
  the revision before the packed GEMM: 8-lane dot products per element), skipped without git;
* `stock fp32`: `torch.nn.functional.linear` in float32; `stock bf16`: the same in bfloat16 (for reference: not
  exact, another dtype).

The kernels run interleaved (one call of each in turn, `--repeats` rounds) after a warm-up call each, and the tables
show medians, so a shared machine's noise falls on all of them alike; compare ratios from one run. In the first table
each shape's one weight stays in the caches between calls; the second runs one forward's linears, 211 distinct
weights (30 layers of the 7 shapes, plus the LM head: 0.54 GB in float32) in a row, so that, as in a real forward,
every weight comes from memory: that is the one-row cost decoding pays (3x the repeats up to 16 rows, whose
forwards are short enough for a busy machine's noise to matter).

    OMP_NUM_THREADS=1 python benchmarks/bench_exact_gemm.py --threads 1

With `--bf16`: the exact bf16 GEMM (`linear_bf16`: x and w rounded to bf16, vdpbf16ps chains, float32 out) against
the exact float32 one and `torch.nn.functional.linear` on bf16 tensors (oneDNN), GFLOP/s by shape and row count
(rows 1 ... 1024), then one forward's 211 weights from memory at the small row counts:

    OMP_NUM_THREADS=1 python benchmarks/bench_exact_gemm.py --bf16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark_hf.kernels import build

ROOT = Path(__file__).resolve().parents[1]
#: the revision whose exact linear is the `old exact` column: the last one before the packed GEMM
DEFAULT_BASELINE = "4a3d8b0"
ROWS = (1, 2, 4, 8, 16, 64, 256, 512)
BF16_ROWS = (1, 4, 16, 64, 256, 512, 1024)
#: (name, out features N, in features K, how many per forward) of SmolLM2-135M (30 layers, tied LM head)
SHAPES = (
    ("q_proj/o_proj", 576, 576, 60),
    ("k_proj/v_proj", 192, 576, 60),
    ("gate/up_proj", 1536, 576, 60),
    ("down_proj", 576, 1536, 30),
    ("lm_head", 49152, 576, 1),
)


def baseline_linear(rev: str):
    """`linear` compiled from `rev`'s exact_kernels.cpp with this build's flags, or None (no git, no compiler)."""
    from torch.utils import cpp_extension

    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:src/dspark_hf/kernels/exact_kernels.cpp"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        name = f"dspark_exact_baseline_{rev}"
        folder = build._extensions_dir() / name
        folder.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load_inline(
            name=name,
            cpp_sources=[source],
            functions=["linear"],
            extra_cflags=build.build_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as err:  # no git checkout, an unknown revision, no compiler
        print(f"(no `old exact` column: {type(err).__name__}: {str(err).strip()[:200]})", file=sys.stderr)
        return None
    return module.linear


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call, after one warm-up call each (the exact kernel packs its weights there), the
    calls interleaved repeat by repeat so that every kernel sees the same machine load."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(timed(call))
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(kernels: dict, rows: int, n: int, k: int, repeats: int) -> dict[str, float]:
    """Median seconds of each kernel on `rows` rows against an [n, k] weight, calls interleaved."""
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    calls = {}
    for name, fn in kernels.items():
        if name == "stock bf16":
            calls[name] = lambda fn=fn: fn(xb, wb, bb)
        else:
            calls[name] = lambda fn=fn: fn(x, w, b)
    return interleaved_medians(calls, repeats)


def measure_forward(kernels: dict, rows: int, repeats: int) -> dict[str, float]:
    """Median seconds of each kernel over one forward's 211 distinct weights, calls interleaved forward by forward."""
    gen = torch.Generator().manual_seed(rows)
    layers = [(n, k) for _, n, k, count in SHAPES for _ in range(count)]
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for n, k in layers]
    inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in layers}}
    bf16 = ([w.bfloat16() for w in weights], {k: x.bfloat16() for k, x in inputs.items()})

    def forward(fn, ws, xs):
        for w in ws:
            fn(xs[w.shape[1]], w, None)

    calls = {}
    for name, fn in kernels.items():
        ws, xs = bf16 if name == "stock bf16" else (weights, inputs)
        calls[name] = lambda fn=fn, ws=ws, xs=xs: forward(fn, ws, xs)
    return interleaved_medians(calls, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the `old exact` column")
    parser.add_argument("--rows", type=int, nargs="*", default=None, help=f"default {ROWS} ({BF16_ROWS} with --bf16)")
    parser.add_argument("--bf16", action="store_true", help="the exact bf16 GEMM against the fp32 one and stock bf16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = build.backend()
    if compiled is None:
        sys.exit("the exact kernels could not be compiled here")
    if args.bf16:
        bf16_tables(compiled, args)
        return
    args.rows = args.rows or list(ROWS)
    kernels = {"exact": compiled.linear}
    old = baseline_linear(args.baseline) if args.baseline else None
    if old is not None:
        kernels["old exact"] = old
    kernels["stock fp32"] = F.linear
    kernels["stock bf16"] = F.linear
    names = list(kernels)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"threads {args.threads}, torch {torch.__version__} ({cpu}), {args.repeats} interleaved repeats, medians\n")
    head = " | ".join(f"{n} ms" for n in names)
    ratios = " | ".join(f"exact / {n}" for n in names[1:3])
    print(f"| shape (N x K) | rows | {head} | exact GFLOP/s | {ratios} |")
    print("|---|---:|" + "---:|" * (len(names) + 1 + len(names[1:3])))
    for label, n, k, _count in SHAPES:
        for rows in args.rows:
            t = measure(kernels, rows, n, k, args.repeats)
            flops = 2 * rows * n * k / t["exact"] / 1e9
            cells = " | ".join(f"{t[name] * 1e3:.3f}" for name in names)
            rel = " | ".join(f"{t['exact'] / t[name]:.2f}" for name in names[1:3])
            print(f"| {label} ({n} x {k}) | {rows} | {cells} | {flops:.0f} | {rel} |", flush=True)
    print("\nOne forward's linears: 211 distinct weights (30 layers x 7 + the LM head), from memory:\n")
    print(
        f"| rows | {head} | "
        + " | ".join(f"exact / {n}" for n in names[1:])
        + " | "
        + " | ".join(f"T(k)/T(1) {n}" for n in names)
        + " |"
    )
    print("|---:|" + "---:|" * (3 * len(names) - 1))
    first = None
    for rows in args.rows:
        t = measure_forward(kernels, rows, args.repeats * (3 if rows <= 16 else 1))  # short calls: noisier
        first = first or t
        cells = " | ".join(f"{t[name] * 1e3:.1f}" for name in names)
        rel = " | ".join(f"{t['exact'] / t[name]:.2f}" for name in names[1:])
        growth = " | ".join(f"{t[name] / first[name]:.1f}" for name in names)
        print(f"| {rows} | {cells} | {rel} | {growth} |", flush=True)


def bf16_tables(compiled, args) -> None:
    """GFLOP/s of the exact bf16 GEMM, the exact fp32 GEMM and stock bf16 by shape and rows; one forward from memory."""
    kernels = {"exact fp32": compiled.linear, "exact bf16": compiled.linear_bf16, "stock bf16": F.linear}
    names = list(kernels)
    rows_list = args.rows or list(BF16_ROWS)
    cpu = torch.backends.cpu.get_cpu_capability()
    native = "vdpbf16ps" if compiled.bf16_native() else "portable kernel"
    print(f"threads {args.threads}, torch {torch.__version__} ({cpu}), exact bf16 on the {native}, ", end="")
    print(f"{args.repeats} interleaved repeats, medians\n")
    print(f"| shape (N x K) | rows | {' | '.join(f'{n} ms' for n in names)} | ", end="")
    print(
        f"{' | '.join(f'{n} GFLOP/s' for n in names)} | exact bf16 / exact fp32 speed | exact bf16 / stock bf16 speed |"
    )
    print("|---|---:|" + "---:|" * (2 * len(names) + 2))
    for label, n, k, _count in SHAPES:
        for rows in rows_list:
            t = measure(kernels, rows, n, k, args.repeats)
            flops = " | ".join(f"{2 * rows * n * k / t[name] / 1e9:.0f}" for name in names)
            cells = " | ".join(f"{t[name] * 1e3:.3f}" for name in names)
            speed = f"{t['exact fp32'] / t['exact bf16']:.2f} | {t['stock bf16'] / t['exact bf16']:.2f}"
            print(f"| {label} ({n} x {k}) | {rows} | {cells} | {flops} | {speed} |", flush=True)
    print("\nOne forward's linears: 211 distinct weights (30 layers x 7 + the LM head), from memory:\n")
    print(
        f"| rows | {' | '.join(f'{n} ms' for n in names)} | exact bf16 / exact fp32 speed | exact bf16 / stock bf16 speed |"
    )
    print("|---:|" + "---:|" * (len(names) + 2))
    for rows in [r for r in rows_list if r <= 16]:
        t = measure_forward(kernels, rows, args.repeats * 3)
        cells = " | ".join(f"{t[name] * 1e3:.1f}" for name in names)
        speed = f"{t['exact fp32'] / t['exact bf16']:.2f} | {t['stock bf16'] / t['exact bf16']:.2f}"
        print(f"| {rows} | {cells} | {speed} |", flush=True)


if __name__ == "__main__":
    main()
