"""The kernel modes, the library's one default, and the one door: [`use_kernels`].

Speculative decoding verifies `k` drafted tokens in one forward of the target. What "lossless" can promise
depends on the kernels that forward runs on:

- `"stock"`: PyTorch's own kernels, untouched. A k-row forward rounds differently from k one-row forwards
  (the matrix product switches from a matrix-vector kernel to a blocked one), so speculative greedy output
  equals plain decoding's only as long as no near-tie of two logits is decided differently; this is an
  empirical property, not a guarantee.
- `"packed"`: oneDNN packed weights for every linear layer (`dspark_hf.kernels.packed`). Faster, but its rows
  are not batch-invariant either.
- `"exact"`: batch-invariant kernels. Every row of a k-row forward is computed by the same sequence of
  floating-point operations as a one-row forward (`dspark_hf.kernels.ops`, `dspark_hf.kernels.lean`).
  Speculative decoding in this mode is token-identical to plain decoding *in the same mode* by construction
  (greedy), and samples from exactly the distribution plain decoding in this mode samples from.
- `"exact-bf16"`: `"exact"` with every linear layer of the target and of the draft (the q/k/v/o and MLP
  projections, the LM head, the draft's context projection and heads) on the exact bf16 GEMM: each linear rounds
  its input row and its weight to bfloat16 (round to nearest even) and sums the exact bf16 products in float32,
  in one fixed order per output element (`exact_linear(..., bf16=True)`, `attn_in_bf16` / `attn_out_bf16`). The
  model stays float32, and so do the activations between linears, the KV cache, the norms, the rotation,
  attention and sampling. It is batch-invariant like `"exact"`, so speculative decoding in this mode is
  token-identical to plain decoding *in this mode* by construction (greedy) and samples from exactly plain
  decoding's distribution in this mode. It is *not* identical to `"exact"` or to any float32 decoding: rounding
  weights and activations to bf16 at every linear changes the logits (by about bf16's relative precision, 2^-8),
  so near-ties, and from there whole continuations, can differ from float32 decoding. The default for a target
  held in bfloat16 on the CPU (whose linears round to bf16 anyway; its weights are held in float32 inside the
  block, losslessly, and in bfloat16 again after it); for a float32 target, opt in by name.

The mode reaches the models through [`use_kernels`] only, for the duration of a `with` block: no process-wide
setting, no environment variable. [`default_kernels`] is the mode the library picks when nobody names one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

import dspark_hf._transformers as tf

from .exact import exact_kernels
from .ops import EXACT_ATTENTION, EXACT_ATTENTION_BF16, is_exact, is_exact_bf16
from .packed import is_packed, packed_linears, packing_available

KERNEL_MODES = ("stock", "packed", "exact", "exact-bf16")
#: The batch-invariant modes (the exact kernels, float32 or bf16 GEMM).
EXACT_MODES = ("exact", "exact-bf16")


def check_kernels(mode: str) -> str:
    """`mode` if it is one of [`KERNEL_MODES`]; a `ValueError` naming the choices otherwise."""
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"Unknown kernel mode {mode!r}; choose one of {', '.join(repr(m) for m in KERNEL_MODES)} "
            "(see dspark_hf.kernels)."
        )
    return mode


def exact_family(model: nn.Module) -> bool:
    """Whether `model` is of a family whose decoder layers the exact mode runs as compiled calls (transformers'
    Llama, Qwen2 and Qwen3 layers)."""
    layer_types = tuple(tf.lean_layer_types())
    return any(isinstance(module, layer_types) for module in model.modules())


def default_kernels(target: nn.Module) -> str:
    """The library's one default kernel mode for `target`, used wherever no mode is named.

    `"exact"` for a target with float32 weights on the CPU of a supported family ([`exact_family`]: Llama, Qwen2,
    Qwen3): batch-invariant and, on the CPUs measured, faster than stock at every batch size decoding uses.
    `"exact-bf16"` for such a target held in bfloat16: its linears as bf16 GEMMs (what a bf16 model computes, summed
    in float32), the rest in float32 (the weights are held in float32 inside the block, losslessly), batch-invariant
    where the stock bf16 kernels are not. `"stock"` otherwise: the exact kernels are CPU kernels (other dtypes or
    devices would run their slow per-row fallback) and other families run only partly on them. Never `"packed"`
    (not batch-invariant; opt in by name).

    Args:
        target (`nn.Module`): the model whose forwards the mode applies to.

    Returns:
        `str`: `"exact"`, `"exact-bf16"` or `"stock"`.
    """
    weight = next((p for p in target.parameters() if p.dim() == 2), None)
    if weight is None or weight.device.type != "cpu" or not exact_family(target):
        return "stock"
    return {torch.float32: "exact", torch.bfloat16: "exact-bf16"}.get(weight.dtype, "stock")


def kernels_of(model: nn.Module) -> str:
    """Which mode `model` currently runs in: `"exact"`, `"exact-bf16"`, `"packed"` or `"stock"`."""
    for module in model.modules():
        if is_exact(module):
            return "exact-bf16" if is_exact_bf16(module) else "exact"
        if is_packed(module):
            return "packed"
    return {EXACT_ATTENTION: "exact", EXACT_ATTENTION_BF16: "exact-bf16"}.get(tf.attn_implementation(model), "stock")


def _flat(models) -> list[nn.Module]:
    """The models of `use_kernels(*models)`, lists flattened and `None` entries dropped."""
    out = []
    for model in models:
        if isinstance(model, (list, tuple)):
            out += _flat(model)
        elif isinstance(model, str):
            raise TypeError(
                f"use_kernels got the string {model!r} among its models; the mode is a keyword argument: "
                f"use_kernels(target, draft, mode={model!r})."
            )
        elif model is not None:
            out.append(model)
    return out


@contextlib.contextmanager
def use_kernels(*models: nn.Module | None, mode: str | None = None) -> Iterator[str]:
    """Run `models` (a target and optionally its draft) on the kernels of `mode` inside the block, then restore them.

    The one way a kernel mode reaches a model: `generate(..., dspark_kernels=...)`, `DSparkEngine(kernels=...)` and
    the command-line tools all enter it.

    Args:
        *models (`nn.Module`, or lists of them): the models to switch (`None` entries are skipped).
        mode (`str`, keyword only, required): `"stock"` (leave them as they are), `"packed"` (oneDNN packed linear weights), `"exact"`
            (batch-invariant kernels) or `"exact-bf16"` (the same with every linear on the exact bf16 GEMM: not
            float32 output); see the module docs, and [`default_kernels`] for the library's default.

    Yields the mode. On a model whose weights are not on the CPU the exact and packed modes change nothing
    (their kernels are CPU kernels).

    Example:

    ```python
    with use_kernels(target, draft, mode=default_kernels(target)):
        out = target.generate(**inputs, assistant_model=draft)
    ```
    """
    flat = _flat(models)
    if mode is None:
        raise TypeError(
            "use_kernels got no mode; name one of "
            f"{', '.join(repr(m) for m in KERNEL_MODES)}, e.g. use_kernels(target, draft, mode=default_kernels(target))."
        )
    check_kernels(mode)
    if mode == "stock":
        yield mode
    elif mode == "packed":
        with packed_linears(*flat, enabled=packing_available()):
            yield mode
    else:
        with exact_kernels(*flat, bf16=mode == "exact-bf16"):
            yield mode
