"""Decoder layers in the exact mode as two compiled calls each: transformers' Llama-family layers and a DSpark
draft's Qwen3-style layers.

A lean layer computes the same arithmetic as the layer it replaces (pre-norm attention with rotary embeddings,
then the SwiGLU MLP, residuals around both) with every per-row operation on the compiled kernels: RMSNorm, the
seven linears, rotary embedding, attention over the cache and the SiLU gate. `attn_in` (norm, q/k/v in one parallel
region, rotation) and `attn_out` (attention, output projection and residual, norm, gate/up in one region, SiLU gate,
down projection and residual) sit around the KV cache's update, bit-identical to calling the kernels one by one.
Skipping ~40 small PyTorch operations, eight module calls and five of seven fork/joins per layer is most of what a
one-token forward of a small model spends outside its matrix products (SmolLM2-135M, 2-core CPU: plain exact
decoding 11% faster than with one call per kernel, docs/cpu-packing.md).

Layers are recognised by their type: transformers' classes come from `dspark_hf._transformers.lean_layer_types`,
the draft's from `dspark_hf.model.layers`.
"""

from __future__ import annotations

import torch
from torch import nn

import dspark_hf._transformers as tf

from ..model.layers import DSparkDecoderLayer
from .build import backend
from .ops import (
    EXACT_ATTENTIONS,
    NO_MASK,
    bool_mask,
    check_attention_options,
    is_exact,
    linear_eligible,
    plain,
    replaced_forward,
)

_LEAN_ARGS = "_dspark_lean_arguments"  # on a lean layer: its weights and constants, gathered when the mode starts
_LEAN_BF16 = "_dspark_lean_bf16"  # on a lean layer of the exact-bf16 mode: its linears run on the bf16 GEMM


def lean_bf16(layer: nn.Module) -> bool:
    """Whether a lean layer's compiled calls are the bf16 ones (`attn_in_bf16` / `attn_out_bf16`: the exact-bf16
    mode)."""
    return bool(layer.__dict__.get(_LEAN_BF16, False))


def lean_arguments(layer: nn.Module) -> tuple[tuple, tuple, tuple] | None:
    """The weights and constants a lean layer's two compiled calls take (`None` for a layer that is not lean):
    `(attn_in's norm and projections, (query heads, key/value heads), attn_out's)`."""
    return layer.__dict__.get(_LEAN_ARGS)


def _weights_ok(linears: list[nn.Module]) -> bool:
    return all((linear_eligible(lin) or is_exact(lin)) and lin.weight.dtype == torch.float32 for lin in linears)


def lean_eligible(layer: nn.Module) -> bool:
    """A transformers Llama/Qwen2/Qwen3 decoder layer that the two compiled calls can run: its own attention and
    RMSNorm types, SiLU MLP, full attention, float32 CPU linears, no hooks (transformers' output capturing aside)."""
    family = tf.lean_layer_types().get(type(layer))
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if family is None or "forward" in layer.__dict__ or attn is None or mlp is None:
        return False
    attention_type, norm_type = family
    if type(attn) is not attention_type or getattr(attn, "sliding_window", None) is not None:
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return (
        getattr(attn.config, "hidden_act", None) == "silu"
        and all(type(n) is norm_type and hasattr(n, "variance_epsilon") for n in norms)
        and _weights_ok(linears)
        and plain(attn, capturing_ok=True)
        and all(plain(m) for m in [mlp, *norms, *linears])
    )


def lean_layer_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """A Llama-family decoder layer's forward in the exact mode: its two compiled calls around the cache update.

    Forwards it does not cover (gradients, other dtypes or devices) run the layer's own forward; a prefill of any
    length is covered.
    """
    attn = self.self_attn
    compiled = backend()
    if (
        compiled is None
        or hidden_states.dtype != torch.float32
        or hidden_states.device.type != "cpu"
        or position_embeddings is None
        or tf.attn_implementation(attn) not in EXACT_ATTENTIONS
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or attn.q_proj.weight.requires_grad))
    ):
        return type(self).forward(
            self,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    check_attention_options(attn, 0.0, kwargs)
    mask = bool_mask(attention_mask)
    cos, sin = position_embeddings
    return lean_layer_run(self, compiled, hidden_states, NO_MASK if mask is None else mask, cache, cos, sin, kwargs)


def lean_layer_run(self, compiled, hidden_states, mask, cache, cos, sin, kwargs) -> torch.Tensor:
    """The two compiled calls of a lean layer around its cache update, once [`lean_layer_forward`] (or the lean
    base model's forward, for all layers at once) has checked that they apply; `mask` is a boolean mask or
    `NO_MASK` (causal over the cache)."""
    norm_etc, head_counts, post_attention = self.__dict__[_LEAN_ARGS]
    bf16 = self.__dict__.get(_LEAN_BF16, False)
    batch, length, width = hidden_states.shape
    x = hidden_states.reshape(batch * length, width)
    # q [B, Hq, L, D], k and v [B, Hkv, L, D]
    q, k, v = (compiled.attn_in_bf16 if bf16 else compiled.attn_in)(x, *norm_etc, cos, sin, batch, length, *head_counts)
    if cache is not None:
        k, v = tf.grow_dynamic_layer(cache, self.self_attn.layer_idx, k, v, kwargs)
    x = (compiled.attn_out_bf16 if bf16 else compiled.attn_out)(x, q, k, v, mask, *post_attention)
    return x.view(batch, length, width)


def _epsilon(norm: nn.Module) -> float:
    """An RMSNorm's epsilon: transformers' norms call it `variance_epsilon`, the draft's `eps`."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _gather_arguments(layer: nn.Module) -> tuple[tuple, tuple, tuple]:
    """The weights and constants of one layer's two compiled calls (a transformers Llama-family layer or a DSpark
    draft's Qwen3-style layer), gathered once when the exact mode starts (a forward then skips ~40 module
    attribute lookups). They are the parameter tensors themselves, so in-place updates of the weights are seen;
    assigning a new parameter object inside the `use_kernels` block is not."""
    attn, mlp, pre, post = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    qk_norm = hasattr(attn, "q_norm")  # Qwen3 and the draft: RMSNorm over each head's vector before the rotation
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    norm_etc = (pre.weight, _epsilon(pre), q.weight, q.bias, k.weight, k.bias, v.weight, v.bias)
    norm_etc += (
        attn.q_norm.weight if qk_norm else None,
        attn.k_norm.weight if qk_norm else None,
        _epsilon(attn.q_norm) if qk_norm else 0.0,
        _epsilon(attn.k_norm) if qk_norm else 0.0,
    )
    head_counts = (q.weight.shape[0] // attn.head_dim, k.weight.shape[0] // attn.head_dim)
    scale = getattr(attn, "scaling", None)  # transformers' layers; the draft's eligible layers use the usual one
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    post_attention = (float(attn.head_dim**-0.5 if scale is None else scale), o.weight, o.bias)
    post_attention += (post.weight, _epsilon(post), gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
    return norm_etc, head_counts, post_attention


def lean_draft_eligible(layer: nn.Module) -> bool:
    """A DSpark draft's Qwen3-style layer that the compiled layer calls can run: SiLU MLP, q/k RMSNorm, no value
    norm, separate value projection, the usual score scale, plain rotary (no scaling), fp32 CPU weights, no hooks."""
    if type(layer) is not DSparkDecoderLayer or "forward" in layer.__dict__:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    config = attn.rotary.config
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return (
        config.hidden_act == "silu"
        and config.rope_parameters.get("rope_type", "default") == "default"
        and attn.v_norm is None
        and not attn.k_eq_v
        and attn.scale is None
        # full attention only (a sliding layer builds its own mask), and the anchor-slot block layout: the compiled
        # drafting round (`dspark_hf.decoding.compiled`, which needs every layer lean) runs a block of block_size
        # slots itself, without `run_backbone`'s DFlash-layout slot
        and attn.sliding_window is None
        and config.sample_from_anchor
        and all(isinstance(lin, nn.Linear) and lin.weight.dtype == torch.float32 for lin in linears)
        and all(lin.weight.device.type == "cpu" for lin in linears)
        and all(plain(m) for m in [layer, attn, mlp, *linears])
    )


def lean_draft_layer_forward(
    self: nn.Module,
    x: torch.Tensor,
    positions: torch.Tensor,
    ctx_keys: torch.Tensor,
    ctx_values: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """A DSpark draft layer (block queries over `[context ; block]` keys, bidirectional) on the two compiled layer
    calls. The draft's arithmetic only has to be close to its PyTorch path (its proposals are verified either
    way): the norms, rotation and attention are the exact kernels' versions of the same formulas."""
    compiled = backend()
    if (
        compiled is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or ctx_keys.dtype != torch.float32
        or (torch.is_grad_enabled() and (x.requires_grad or self.self_attn.q_proj.weight.requires_grad))
    ):
        return type(self).forward(self, x, positions, ctx_keys, ctx_values, attention_mask)
    attn = self.self_attn
    batch, length, width = x.shape
    cos, sin = attn.rotary.cos_sin(positions, x.dtype)  # [B, 1, S, hd]
    norm_etc, head_counts, post_attention = self.__dict__[_LEAN_ARGS]
    bf16 = self.__dict__.get(_LEAN_BF16, False)
    rows = x.reshape(batch * length, width)
    attn_in = compiled.attn_in_bf16 if bf16 else compiled.attn_in
    q, k, v = attn_in(rows, *norm_etc, cos[:, 0], sin[:, 0], batch, length, *head_counts)
    if bf16:  # the mode's keys and values are bf16 values (the compiled round's `draft_ingest` rounds them too)
        ctx_keys, ctx_values = ctx_keys.to(torch.bfloat16).float(), ctx_values.to(torch.bfloat16).float()
    keys = torch.cat([ctx_keys, k], dim=-2)
    values = torch.cat([ctx_values, v], dim=-2)
    if attention_mask is None:  # the block sees all of its context and itself
        attention_mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
    out = (compiled.attn_out_bf16 if bf16 else compiled.attn_out)(
        rows, q, keys, values, attention_mask, *post_attention
    )
    return out.view(batch, length, width)


def make_lean(layer: nn.Module, forward, bf16: bool = False) -> None:
    """Swap `layer`'s forward for `forward` (one of the two above), with its compiled calls' arguments; with `bf16`
    its linears run on the bf16 GEMM (`attn_in_bf16` / `attn_out_bf16`, the exact-bf16 mode)."""
    layer.__dict__[_LEAN_ARGS] = _gather_arguments(layer)
    layer.__dict__[_LEAN_BF16] = bool(bf16)
    layer.forward = forward.__get__(layer)


def unmake_lean(layer: nn.Module) -> None:
    """Undo [`make_lean`] (a layer that was not swapped is left as it is)."""
    if is_lean(layer):
        del layer.forward
    layer.__dict__.pop(_LEAN_ARGS, None)
    layer.__dict__.pop(_LEAN_BF16, None)


def is_lean(layer: nn.Module) -> bool:
    """Whether a decoder layer currently runs the exact mode's lean path ([`lean_layer_forward`], or for a DSpark
    draft's layer [`lean_draft_layer_forward`])."""
    return replaced_forward(layer) in (lean_layer_forward, lean_draft_layer_forward)
