"""The exact mode's swaps: what `use_kernels(models, mode="exact")` changes on a target and its draft, and undoes.

* every plain CPU `nn.Linear` runs [`exact_linear`] (`dspark_hf.kernels.ops`);
* every transformers model whose attention goes through `AttentionInterface` runs [`exact_attention_forward`];
* its Llama/Qwen2/Qwen3 decoder layers run as two compiled calls each and its base model's forward as one
  compiled call for all layers (`dspark_hf.kernels.lean`, `dspark_hf.kernels.lean_model`);
* a DSpark draft's Qwen3-style layers, its RMSNorms and its functional linears (subset LM-head rows, the Markov
  head's projection) run the same compiled kernels. Only the draft's speed changes: its tokens are verified
  either way.

In the exact-bf16 mode (`exact_kernels(..., bf16=True)`) the same swaps are made with the bf16 GEMM in every
linear: [`exact_linear_forward_bf16`], [`exact_functional_linear_bf16`] and lean layers whose compiled calls are
`attn_in_bf16` / `attn_out_bf16` (the layer stack's `stack_run(..., bf16=True)`). Its keys and values are held at
bfloat16 precision: the compiled calls round them when they compute them, and the models' attention is
[`exact_attention_forward_bf16`] (`"dspark_exact_bf16"`), which rounds what it is given, so every path attends over
the same values (the engine stores them in bfloat16: half the bytes of its KV cache).

Every swap is an instance-bound method on the module it changes; nothing is written into modules that are not
swapped, and the block's end removes every swap it made. Models or modules already in the exact mode (an enclosing
block) are left as they are.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import nn

import dspark_hf._transformers as tf

from ..model.heads import MarkovHead
from ..model.layers import RMSNorm
from ..model.modeling import DSparkDraftModel
from .build import backend
from .lean import (
    lean_draft_eligible,
    lean_draft_layer_forward,
    lean_eligible,
    lean_layer_forward,
    make_lean,
    unmake_lean,
)
from .lean_model import lean_model_eligible, make_lean_model, unmake_lean_model
from .ops import (
    EXACT_ATTENTION,
    EXACT_ATTENTION_BF16,
    exact_functional_linear,
    exact_functional_linear_bf16,
    exact_linear_forward,
    exact_linear_forward_bf16,
    exact_norm_forward,
    is_exact,
    is_exact_functional,
    is_exact_norm,
    linear_eligible,
    plain,
    register_attention,
)

#: The draft modules whose functional linears ([`exact_functional_linear`]) follow the mode.
_FUNCTIONAL_OWNERS = (DSparkDraftModel, MarkovHead)


def _draft_norm_eligible(module: nn.Module) -> bool:
    """A DSpark draft's own (Qwen3-style) RMSNorm with fp32 CPU weights and no hooks."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is RMSNorm
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and plain(module)
    )


class _Swaps:
    """What one exact block changed, to undo it in [`exact_kernels`]'s `finally`."""

    def __init__(self, bf16: bool = False) -> None:
        self.bf16 = bf16
        self.attention: list[tuple[nn.Module, str]] = []
        self.forwards: list[nn.Module] = []  # linears and draft norms: a replaced `forward`
        self.functional: list[nn.Module] = []
        self.layers: list[nn.Module] = []
        self.models: list[nn.Module] = []

    def apply(self, model: nn.Module) -> None:
        current = tf.attn_implementation(model)
        wanted = EXACT_ATTENTION_BF16 if self.bf16 else EXACT_ATTENTION
        if current is not None and current != wanted and tf.supports_attention_backend(model):
            model.set_attn_implementation(wanted)
            self.attention.append((model, current))
        compiled = backend() is not None
        exact_attention = tf.attn_implementation(model) == wanted
        lean = [m for m in model.modules() if lean_eligible(m)] if compiled and exact_attention else []
        for module in model.modules():
            if linear_eligible(module):
                module.forward = (exact_linear_forward_bf16 if self.bf16 else exact_linear_forward).__get__(module)
                self.forwards.append(module)
            if isinstance(module, _FUNCTIONAL_OWNERS) and "functional_linear" not in module.__dict__:
                functional = exact_functional_linear_bf16 if self.bf16 else exact_functional_linear
                module.functional_linear = functional.__get__(module)
                self.functional.append(module)
        for layer in lean:
            make_lean(layer, lean_layer_forward, bf16=self.bf16)
            self.layers.append(layer)
        for base in [m for m in model.modules() if lean_model_eligible(m)] if lean else []:
            make_lean_model(base)  # then the base model itself (all of its layers lean): one call for all layers
            self.models.append(base)
        if compiled:  # a DSpark draft's own layers and norms: the same compiled calls
            self._apply_draft(model)

    def _apply_draft(self, model: nn.Module) -> None:
        for layer in [m for m in model.modules() if lean_draft_eligible(m)]:
            make_lean(layer, lean_draft_layer_forward, bf16=self.bf16)
            self.layers.append(layer)
        for norm in [m for m in model.modules() if _draft_norm_eligible(m)]:
            norm.forward = exact_norm_forward.__get__(norm)
            self.forwards.append(norm)

    def undo(self) -> None:
        for base in self.models:
            unmake_lean_model(base)
        for layer in self.layers:
            unmake_lean(layer)
        for module in self.forwards:
            if is_exact(module) or is_exact_norm(module):
                del module.forward
        for module in self.functional:
            if is_exact_functional(module):
                del module.functional_linear
        for model, previous in reversed(self.attention):
            model.set_attn_implementation(previous)


def _upcast_bf16(model: nn.Module) -> list[torch.Tensor]:
    """Hold `model`'s bfloat16 CPU parameters and buffers in float32 (in place, `tensor.data` swapped: the same
    parameter objects); returns them, for [`_downcast`]. Lossless: every bfloat16 value is a float32 value."""
    held = []
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu":
            tensor.data = tensor.data.float()
            held.append(tensor)
    return held


def _downcast(held: list[torch.Tensor]) -> None:
    """Back to bfloat16 what [`_upcast_bf16`] held in float32 (exactly the values it had)."""
    for tensor in held:
        tensor.data = tensor.data.to(torch.bfloat16)


@contextlib.contextmanager
def exact_kernels(*models: nn.Module | None, bf16: bool = False) -> Iterator[None]:
    """Run `models` on the exact kernels inside the block, then restore them (the exact mode of `use_kernels`;
    with `bf16`, the exact-bf16 mode: every linear on the bf16 GEMM). The kernels are float32 ones: a model held
    in bfloat16 on the CPU is held in float32 inside the block (lossless) and in bfloat16 again after it."""
    backend()  # build (or load) the kernels now, not inside the first forward
    register_attention()
    swaps = _Swaps(bf16)
    held: list[torch.Tensor] = []
    try:
        for model in models:
            if model is not None:
                held += _upcast_bf16(model)
                swaps.apply(model)
        yield
    finally:
        swaps.undo()
        _downcast(held)
