"""The exact linear kernel with and without its weight prefetch, on a SmolLM2-135M-shaped stack of cold weights.

Builds `dspark_hf/kernels/exact_kernels.cpp` (with `exact_stack.cpp`, as the package does) twice (`-DPREFETCH_TILES=0`, i.e. no prefetch, and the given
distances), checks that every build gives bit-identical outputs, then times the 30 layers' linears plus the
49,152-row LM head (about 540 MB of fp32 weights, far more than the CPU's caches, as in a real forward) at
1, 4, 8 and 16 rows, next to stock `F.linear`; builds and row counts interleaved in every repeat, medians.
`--baseline-rev REV` adds the kernel source of a git revision (default prefetch), to time a change of the
kernel's tiling against the code before it; its outputs are checked bit-identical too.

    python benchmarks/bench_exact_prefetch.py --distances 2 4 8 --repeats 5 --threads 2
    python benchmarks/bench_exact_prefetch.py --distances 4 --rows 1 2 3 4 5 8 --baseline-rev 14e1650
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from dspark_hf.kernels.build import SOURCES, build_flags

KERNELS = Path(__file__).resolve().parents[1] / "src" / "dspark_hf" / "kernels"


def build(distance: int | None, root: Path, source: str | None = None):
    flags = [*build_flags()] + ([] if distance is None else [f"-DPREFETCH_TILES={distance}"])
    source = "".join((KERNELS / name).read_text() for name in SOURCES) if source is None else source
    name = "bench_exact_" + hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:10]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(
        name=name, cpp_sources=[source], functions=["linear"], extra_cflags=flags, extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--distances", type=int, nargs="+", default=[4], help="prefetch distances (tiles) to build")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-rev", default=None, help="also time the kernel source of this git revision")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench_exact_prefetch_"))
    builds = {f"prefetch {d}": build(d, root) for d in [0, *args.distances]}
    if args.baseline_rev:
        path = SOURCE.relative_to(SOURCE.parents[3]).as_posix()
        old = subprocess.run(
            ["git", "show", f"{args.baseline_rev}:{path}"],
            cwd=SOURCE.parents[3],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        builds[f"at {args.baseline_rev}"] = build(None, root, old)
    torch.manual_seed(0)
    weights = []
    for _ in range(30):  # q, k, v, o, gate, up, down of SmolLM2-135M
        weights += [torch.randn(576, 576), torch.randn(192, 576), torch.randn(192, 576), torch.randn(576, 576)]
        weights += [torch.randn(1536, 576), torch.randn(1536, 576), torch.randn(576, 1536)]
    weights.append(torch.randn(49152, 576))  # the LM head
    for m in sorted({1, 2, 3, 5, 8, *args.rows}):
        x = torch.randn(m, 576)
        reference = builds["prefetch 0"].linear(x, weights[-1], None)
        for name, ext in builds.items():
            assert torch.equal(ext.linear(x, weights[-1], None), reference), f"{name} changed the results ({m} rows)"
    methods = {"stock F.linear": lambda x, w: F.linear(x, w)}
    methods.update({name: (lambda e: lambda x, w: e.linear(x, w, None))(ext) for name, ext in builds.items()})
    times: dict = {}
    for _ in range(args.repeats):
        for m in args.rows:
            inputs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
            for name, fn in methods.items():
                start = time.perf_counter()
                for w in weights:
                    fn(inputs[w.shape[1]], w)
                times.setdefault((m, name), []).append(time.perf_counter() - start)
    print("| rows | " + " | ".join(methods) + " |")
    print("|---:|" + "---:|" * len(methods))
    for m in args.rows:
        cells = [f"{statistics.median(times[(m, name)]) * 1e3:.1f} ms" for name in methods]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
