"""The exact mode's batch-invariant operations: linear, attention over a KV cache, and the draft's RMSNorm.

Every row of a k-row call is computed by the same sequence of floating-point operations as a one-row call. Float32
CPU tensors run on the compiled kernels ([`build.backend`]); anything else runs a pure-PyTorch fallback that
computes each row with its own one-row call (row-invariant by construction, slower). This module also holds the
instance-bound forwards that put an `nn.Linear`, a DSpark draft's functional linears and its RMSNorms on these
operations (swapped in and out by `dspark_hf.kernels.exact`).

They cover every number of rows: a prefill of any length is computed row by row exactly as decoding computes it
(the linear's fma chain over k, the attention's reduction over the keys a query may see, in ascending order), so a
prompt's keys, values and logits are the same whether it is prefilled in one forward (`generate()`), in chunks of
any sizes (the engine's chunked prefill) or token by token (`tests/kernels/test_exact_prefill.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dspark_hf._transformers as tf

from .build import backend

#: The attention implementation name registered with transformers' `AttentionInterface` for the exact mode.
EXACT_ATTENTION = "dspark_exact"
#: The same for the exact-bf16 mode: the exact attention over keys and values rounded to bfloat16.
EXACT_ATTENTION_BF16 = "dspark_exact_bf16"
#: Both names: a model set to either runs the exact attention.
EXACT_ATTENTIONS = (EXACT_ATTENTION, EXACT_ATTENTION_BF16)

#: The attention kernel's "causal over the cache" (no mask).
NO_MASK = torch.empty(0, dtype=torch.bool)


def _off_the_kernels(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs the exact kernels do not cover: gradients wanted, or anything but float32 on the CPU."""
    return (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


# ---------------------------------------------------------------------------------------------- linears
def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, bf16: bool = False
) -> torch.Tensor:
    """`x @ weight.T + bias` with every row of `x` computed exactly as it would be alone (batch-invariant).

    Float32 CPU tensors run on the compiled kernel; anything else (and every input when the kernel is not
    available) runs one `torch.nn.functional.linear` call per row, which is row-invariant by construction.
    With `bf16`, `x` and `weight` are rounded to bfloat16 (the compiled `linear_bf16`: float32 sums of bf16
    products, float32 out; the per-row fallback computes `F.linear` on the rounded values in float32).
    """
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    compiled = backend()
    if compiled is not None and rows.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
        kernel = compiled.linear_bf16 if bf16 else compiled.linear
        out = kernel(rows, weight.detach(), None if bias is None else bias.detach())
    else:
        if bf16:
            rows, weight = rows.bfloat16().float(), weight.bfloat16().float()
        if rows.shape[0] == 1:
            out = F.linear(rows, weight, bias)
        else:
            out = torch.cat([F.linear(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
    return out.reshape(*lead, weight.shape[0])


def replaced_forward(module: nn.Module, name: str = "forward"):
    """The function behind an instance-bound replacement of `module.<name>`, or `None` when there is none."""
    return getattr(module.__dict__.get(name), "__func__", None)


def plain(module: nn.Module, capturing_ok: bool = False) -> bool:
    """No hooks and no replaced forward (the exact linear's excepted): calling its kernels directly skips nothing.
    With `capturing_ok`, transformers' output-capturing hooks are allowed (they only record attention weights on an
    attention module, which the exact attention never returns)."""
    return (
        all(capturing_ok and tf.is_output_capturing_hook(h) for h in tf.forward_hooks(module))
        and not tf.has_forward_pre_hooks(module)
        and ("forward" not in module.__dict__ or is_exact(module))
    )


def linear_eligible(module: nn.Module) -> bool:
    """A plain CPU `nn.Linear` (not a subclass, quantised or LoRA-wrapped, and not already hooked)."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__  # already hooked (accelerate offload, packing)
        and isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.layout == torch.strided
    )


def exact_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear`'s forward in the exact mode, at every number of rows (gradients and other dtypes keep the
    stock one)."""
    if (
        x.device.type != "cpu"
        or x.dtype != self.weight.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
    ):
        return nn.Linear.forward(self, x)
    return exact_linear(x, self.weight, self.bias)


def exact_linear_forward_bf16(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear`'s forward in the exact-bf16 mode: [`exact_linear_forward`] on the bf16 GEMM
    (`exact_linear(..., bf16=True)`: x and the weight rounded to bfloat16, float32 sums, float32 out)."""
    if (
        x.device.type != "cpu"
        or x.dtype != self.weight.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
    ):
        return nn.Linear.forward(self, x)
    return exact_linear(x, self.weight, self.bias, bf16=True)


def is_exact(module: nn.Module) -> bool:
    """Whether `module` (an `nn.Linear`) currently runs on an exact kernel (float32 or bf16 GEMM)."""
    return replaced_forward(module) in (exact_linear_forward, exact_linear_forward_bf16)


def is_exact_bf16(module: nn.Module) -> bool:
    """Whether `module` (an `nn.Linear`) currently runs on the exact bf16 GEMM (the exact-bf16 mode)."""
    return replaced_forward(module) is exact_linear_forward_bf16


def exact_functional_linear(
    self: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A DSpark draft's `functional_linear` (its subset LM-head rows, its Markov head's output projection) in the
    exact mode: [`exact_linear`] on float32 CPU inference, `F.linear` otherwise.

    These weights are cached slices, not `nn.Linear` modules, so swapping the modules alone would leave them on the
    stock kernel, whose 2-16-row GEMM path re-packs the weight on every call: ~3.5x the exact kernel's time for the
    8,192-row draft LM head on 7 rows (measured on the 2-core CPU of docs/cpu-packing.md). Only speed changes for a
    draft: its tokens are verified either way.
    """
    if _off_the_kernels(x, weight):
        return F.linear(x, weight, bias)
    return exact_linear(x, weight, bias)


def exact_functional_linear_bf16(
    self: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[`exact_functional_linear`] on the bf16 GEMM (the exact-bf16 mode)."""
    if _off_the_kernels(x, weight):
        return F.linear(x, weight, bias)
    return exact_linear(x, weight, bias, bf16=True)


def is_exact_functional(module: nn.Module) -> bool:
    """Whether a draft module's `functional_linear` currently runs on an exact kernel (float32 or bf16 GEMM)."""
    return replaced_forward(module, "functional_linear") in (exact_functional_linear, exact_functional_linear_bf16)


# ---------------------------------------------------------------------------------------------- the draft's norm
def exact_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A DSpark draft's RMSNorm on the compiled `rms_norm` (the one the lean layers and the compiled drafting round
    use), so that the draft's PyTorch-level path and its compiled round compute the same values. Only the draft's
    speed and its exact bits change: its proposals are verified either way."""
    compiled = backend()
    if compiled is None or _off_the_kernels(x, self.weight):
        return type(self).forward(self, x)
    return compiled.rms_norm(x.reshape(-1, x.shape[-1]), self.weight.detach(), self.eps).view(x.shape)


def is_exact_norm(module: nn.Module) -> bool:
    """Whether a DSpark draft's RMSNorm currently runs on the compiled `rms_norm`."""
    return replaced_forward(module) is exact_norm_forward


# ---------------------------------------------------------------------------------------------- attention
def check_attention_options(module: nn.Module, dropout: float, kwargs: dict) -> None:
    """Refuse the attention variants the exact kernels do not implement, naming the way out."""
    for name in ("s_aux", "sinks", "softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"The exact kernel mode does not support attention with `{name}` (model "
                f"{type(module).__name__}); use kernels='stock' or 'packed' for this model."
            )
    if dropout and module.training:
        raise NotImplementedError(
            f"The exact kernel mode is for inference; got attention dropout {dropout} on a module in training mode. "
            "Call model.eval(), or use kernels='stock' to train."
        )


def bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' attention mask as booleans (true = may attend); an additive float mask allows what is finite."""
    if mask is not None and mask.dtype != torch.bool:
        mask = torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min)
    return mask


def exact_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (registered as `"dspark_exact"`) whose query rows are batch-invariant.

    Each query attends to the keys its mask allows (causal over the cache when the mask is `None`), and is
    computed exactly as a one-query call over the same visible keys computes it. Shapes follow transformers'
    convention: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]`; returns `([B, Lq, Hq, D], None)`.
    """
    check_attention_options(module, dropout, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = bool_mask(attention_mask)
    compiled = backend()
    kv_dtypes = (torch.float32, torch.bfloat16)  # bfloat16: an exact-bf16 cache; widened exactly
    if (
        compiled is not None
        and query.dtype == torch.float32
        and key.dtype == value.dtype
        and key.dtype in kv_dtypes
        and query.device.type == "cpu"
    ):
        return compiled.attention(query, key, value, NO_MASK if mask is None else mask, float(scale)), None
    if query.dtype == torch.float32 and key.dtype == value.dtype == torch.bfloat16:
        key, value = key.float(), value.float()
    return _attention_fallback(query, key, value, mask, scale), None


def exact_attention_forward_bf16(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs
) -> tuple[torch.Tensor, None]:
    """The exact-bf16 mode's attention function (registered as `"dspark_exact_bf16"`): [`exact_attention_forward`]
    over the keys and values rounded to bfloat16 (to nearest even, torch's conversion), the values the mode's
    compiled layers hold in their KV caches. Rounding is idempotent, so keys already rounded (or held in
    bfloat16) are unchanged: every path of the mode attends over the same values."""
    if query.dtype == torch.float32 and key.dtype == value.dtype == torch.float32:
        key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    return exact_attention_forward(module, query, key, value, *args, **kwargs)


def _attention_fallback(query, key, value, mask, scale) -> torch.Tensor:
    """One query at a time over exactly the keys it may see (its causal prefix): row-invariant by construction."""
    batch, heads, q_len, dim = query.shape
    kv_len, rep = key.shape[2], heads // key.shape[1]
    outs = []
    for i in range(q_len):
        visible = kv_len - q_len + i + 1
        q = query[:, :, i : i + 1].contiguous()
        k = key[:, :, :visible].repeat_interleave(rep, dim=1).contiguous()
        v = value[:, :, :visible].repeat_interleave(rep, dim=1).contiguous()
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            row = mask[..., i : i + 1, :visible].expand(batch, heads, 1, visible)
            scores = scores.masked_fill(~row, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row (padding): zeros
        outs.append(torch.matmul(probs, v))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def register_attention() -> None:
    """Register [`exact_attention_forward`] with transformers as `"dspark_exact"` and
    [`exact_attention_forward_bf16`] as `"dspark_exact_bf16"` (once)."""
    tf.register_attention(EXACT_ATTENTION, exact_attention_forward)
    tf.register_attention(EXACT_ATTENTION_BF16, exact_attention_forward_bf16)
