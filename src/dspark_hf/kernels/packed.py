"""Packed linear weights for CPU verification: a 2–16-token forward at the cost of a 1-token one.

On a CPU, `torch.nn.functional.linear` multiplies a handful of rows (`M` = 2…16, the tokens of one
verification) through a general matrix product that re-reads and re-packs the weight on every call; for
SmolLM2-135M on 2 threads a 2-token forward costs 1.6x a 1-token forward, which alone puts the break-even τ
of speculative decoding near 1.6. oneDNN can pack each weight once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the kernel behind `torch.compile`'s CPU weight freezing) and
then multiply any small `M` at about the cost of `M = 1` (`torch.ops.mkldnn._linear_pointwise`).

[`packed_linears`] does that for the duration of a `with` block: every eligible `nn.Linear` of a model runs
on a packed copy of its weight, computed once and kept on the module (it is recomputed when the weight
changes). The function computed is the same `x @ W.T + b`; only the summation order inside the kernel
differs, which is the same kind of difference as between a 1-token and a k-token forward of the stock
kernel. `use_kernels(models, mode="packed")` (`dspark_hf.kernels.modes`) runs a target and its draft on it
for a `with` block; it is never the default, because the packed kernel rounds differently from the stock one,
and on one real prompt (of 32 in `dspark eval`) that flipped a near-tied greedy choice: the output was no longer
token-identical to stock plain `generate()`. [`pack_linear_weights`] keeps a model packed until
[`unpack_linear_weights`], so benchmarks can give plain decoding the same kernels.

Cost: one extra copy of every packed weight in memory (for SmolLM2-135M, 0.5 GB), built in ~0.3 s on the
first call.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

#: The row count the packed layout is tuned for; oneDNN's packed kernel stays near its 1-row cost up to
#: about 16 rows with this hint on an AVX-512 CPU (measured in `benchmarks/bench_cpu_packing.py`).
PACK_BATCH_HINT = 8

#: Above this many rows (a prefill, a large batch) the stock kernel is used: packing targets the few-row
#: products of decoding and verification (measured faster than the stock kernel up to 256 rows here).
PACKED_MAX_ROWS = 256


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear kernels."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _eligible(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear  # subclasses (quantised, LoRA-wrapped …) keep their own forward
        and "forward" not in module.__dict__  # already hooked (accelerate offload, another packing)
        and isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _bf16_packing_supported()))
        and weight.layout == torch.strided
    )


def _bf16_packing_supported() -> bool:
    """oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere bf16 linears
    keep the stock kernel (the packing call would raise)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def _packed_weight(module: nn.Linear) -> torch.Tensor:
    """The packed copy of `module.weight`, rebuilt when the weight was replaced or modified in place."""
    weight = module.weight
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
    cached = module.__dict__.get("_dspark_packed")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        cached = (key, packed)
        module.__dict__["_dspark_packed"] = cached
    return cached[1]


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Training, autocast, other dtypes or devices: the stock kernel (the packed one has no backward).
    if (
        x.dtype != self.weight.dtype
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        or x.dim() < 2
        or x.numel() > PACKED_MAX_ROWS * x.shape[-1]
    ):
        return nn.Linear.forward(self, x)
    bias = self.bias.detach() if self.bias is not None else None
    return _packed_matmul(x.contiguous(), _packed_weight(self), bias)


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> list[nn.Linear]:
    """Make every eligible `nn.Linear` of `model` (CPU, fp32/bf16, not already hooked) use packed weights.

    Stays in effect until [`unpack_linear_weights`]. Returns the modules it changed. Does nothing (returns
    `[]`) when [`packing_available`] is false.
    """
    return _pack(model) if packing_available() else []


def _pack(model: nn.Module) -> list[nn.Linear]:
    changed = []
    for module in model.modules():
        if _eligible(module):
            _packed_weight(module)
            module.forward = types.MethodType(_packed_forward, module)
            changed.append(module)
    return changed


def unpack_linear_weights(model: nn.Module | list[nn.Module]) -> None:
    """Undo [`pack_linear_weights`] on `model` (or on the list of modules it returned) and free the copies."""
    modules = model if isinstance(model, list) else list(model.modules())
    for module in modules:
        if is_packed(module):
            del module.forward
        module.__dict__.pop("_dspark_packed", None)


@contextlib.contextmanager
def packed_linears(*models: nn.Module | None, enabled: bool = True) -> Iterator[list[nn.Linear]]:
    """Run the eligible linears of `models` on packed weights inside the block, then restore them (the packed
    mode of `use_kernels`).

    The packed copies stay cached on the modules, so the next block starts at once; call
    [`unpack_linear_weights`] to free them. With `enabled=False` (or without oneDNN's packed kernels) nothing
    changes. Modules that are already packed (by [`pack_linear_weights`] or an enclosing block) are left as they
    are. Yields the modules it changed.
    """
    changed: list[nn.Linear] = []
    try:
        if enabled and packing_available():
            for model in models:
                if model is not None:
                    changed += _pack(model)
        yield changed
    finally:
        for module in changed:
            if is_packed(module):
                del module.forward


def is_packed(module: nn.Module) -> bool:
    """Whether `module` currently runs on a packed weight."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _packed_forward
