"""The exact kernels' C++ extension (`exact_kernels.cpp`, then `exact_stack.cpp`, one source): built with `torch.utils.cpp_extension` at first use.

The build takes about a minute, needs a C++ compiler and `ninja`, and is cached under `$TORCH_EXTENSIONS_DIR` or
`$DSPARK_HF_CACHE/torch_extensions`, keyed by a hash of the source, the compiler flags and the torch and Python
versions. Without a compiler the exact mode runs its pure-PyTorch fallback (identical by construction, slower).
Nothing here reads a dspark environment variable: the build is a cache of the extension, not a setting.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

from .._paths import cache_dir

#: The functions `exact_kernels.cpp` exports to Python.
FUNCTIONS = (
    "linear",
    "linear_bf16",
    "linear_bf16_portable",
    "bf16_native",
    "pack_bytes",
    "pack_release",
    "attention",
    "attention_segments",
    "rms_norm",
    "rope",
    "silu_mul",
    "attn_in",
    "attn_out",
    "attn_in_bf16",
    "attn_out_bf16",
    "stack_add_layer",
    "stack_free",
    "stack_run",
    "stack_run_varlen",
    "draft_ingest",
    "draft_block_run",
    "markov_greedy",
    "round_to_bf16_",
)

#: The C++ sources, compiled as one translation unit in this order (the second calls the first's helpers).
SOURCES = ("exact_kernels.cpp", "exact_stack.cpp")

# The compiled extension once loaded, or False when it could not be built: a cache of the build, not a mode.
_BACKEND: object | None = None
_BUILD_LOCK = threading.Lock()


def _extensions_dir() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else cache_dir() / "torch_extensions"


def build_flags() -> list[str]:
    """The compiler flags of this CPU's build: strict IEEE order (no contraction, no fast math), AVX2/AVX-512."""
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    if capability == "AVX512":
        # the same 8-lane arithmetic, with AVX-512VL's 32 vector registers: a verification forward of up to 8 rows
        # then reads each weight tile once (exact_kernels.cpp, rows_tile)
        flags += ["-mavx512f", "-mavx512vl"]
        if _cpu_has_avx512_bf16():
            # vdpbf16ps for the bf16 GEMM (linear_bf16); without it the same chains run on a portable kernel
            flags += ["-mavx512bf16"]
    return flags


def _cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX-512 BF16 (Linux: /proc/cpuinfo's flags; elsewhere: assumed not)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
    except OSError:
        return False


def _build():
    from torch.utils import cpp_extension

    try:  # the `ninja` package's binary, in case its folder is not on PATH (a venv that is not activated)
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    source = "".join(Path(__file__).with_name(name).read_text() for name in SOURCES)
    flags = build_flags()
    key = hashlib.sha256("\n".join([source, *flags, torch.__version__, sys.version]).encode()).hexdigest()[:12]
    name = f"dspark_exact_{key}"
    folder = _extensions_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(
        name=name,
        cpp_sources=[source],
        functions=list(FUNCTIONS),
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def _load() -> object:
    try:
        return _build()
    except Exception as err:  # no compiler, no ninja, a read-only cache ...
        warnings.warn(
            f"dspark_hf could not build its exact CPU kernels ({type(err).__name__}: {err}); the exact kernel mode "
            "uses its pure-PyTorch fallback, which is exact but slower. Install a C++ compiler and "
            "`pip install ninja` to get the fast kernels.",
            stacklevel=4,
        )
        return False


def backend():
    """The compiled extension, built on first use; `None` when it cannot be built (then the fallback runs)."""
    global _BACKEND
    if _BACKEND is None:
        with _BUILD_LOCK:
            if _BACKEND is None:
                _BACKEND = _load()
    return _BACKEND or None


def exact_kernels_backend() -> str:
    """Which implementation the exact mode runs: `"cpp"` (the compiled kernels) or `"torch"` (the fallback).

    Builds the kernels on first call.
    """
    return "cpp" if backend() is not None else "torch"


def exact_kernels_build() -> str:
    """Which build of the exact kernels runs: `"cpp-<key>"` (a hash of the C++ source, the compiler flags and the
    torch and Python versions) or `"torch"` (the fallback). Cost measurements taken on the exact kernels (the SPS
    profile) record it, so that a kernel change invalidates them."""
    compiled = backend()
    if compiled is None:
        return "torch"
    return "cpp-" + compiled.__name__.removeprefix("dspark_exact_")  # the key _build named the extension with


def build_exact_kernels() -> str:
    """Build (or load from the cache) the exact kernels now rather than on first use; returns the backend name."""
    return exact_kernels_backend()
