"""A Llama/Qwen2/Qwen3 base model's forward in the exact mode, with all its lean layers in one compiled call.

Once every decoder layer of a base model is lean ([`dspark_hf.kernels.lean`]), the model's forward is replaced by
[`lean_model_forward`]: transformers' own steps (embedding, cache, positions, causal mask, rotary embedding, the
decoder layers, final norm), with the layers run as one compiled call (`stack_run`) once the cache has buffers to
write into, else each lean layer's two calls made directly; either way without the layers' module calls and
argument checks and without transformers' output-capturing, config-defaults and keyword-deprecation wrappers. The
same kernel calls as the layers' own lean forwards, so the output is bit-identical; what goes is ~2 ms of Python
per one-token forward of SmolLM2-135M (docs/cpu-packing.md).

Everything this needs from transformers (the model classes, the causal mask, the cache and output types, the
output collector) is asked through `dspark_hf._transformers`.
"""

from __future__ import annotations

import inspect
import itertools

import torch
from torch import nn

import dspark_hf._transformers as tf

from .build import backend
from .lean import is_lean, lean_arguments, lean_bf16, lean_layer_forward, lean_layer_run
from .ops import EXACT_ATTENTIONS, NO_MASK, bool_mask, replaced_forward

_LEAN_MODEL_PARAMETERS = ("self", "input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache")
# on a base model in the exact mode: (handle, [(layer, cache index, Hkv, D)], bf16: the layers' linears on the bf16 GEMM)
_LEAN_STACK = "_dspark_lean_stack"


def lean_model_eligible(model: nn.Module) -> bool:
    """A transformers Llama/Qwen2/Qwen3 base model whose forward is the one [`lean_model_forward`] reproduces
    (its parameters, its output's `cache` field, full attention in every layer) and all of whose layers are lean."""
    if type(model) not in tf.lean_model_types() or "forward" in model.__dict__:
        return False
    try:
        parameters = tuple(inspect.signature(inspect.unwrap(type(model).forward)).parameters)
    except (TypeError, ValueError):
        return False
    layers = getattr(model, "layers", None)
    config = model.config
    return (
        parameters[: len(_LEAN_MODEL_PARAMETERS)] == _LEAN_MODEL_PARAMETERS
        and tf.base_output_has_cache()
        and tf.active_output_collector() != tf.UNKNOWN_COLLECTOR
        and isinstance(layers, nn.ModuleList)
        and len(layers) >= config.num_hidden_layers > 0
        and all(is_lean(layer) for layer in layers[: config.num_hidden_layers])
        and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"]))
        and isinstance(getattr(model, "embed_tokens", None), nn.Embedding)
    )


def _covered(model: nn.Module, input_ids, attention_mask, inputs_embeds, kwargs: dict) -> bool:
    """Whether [`lean_model_forward`] covers this call: not when hidden states or attentions are asked for (here or
    in the config), `return_dict=False`, other keyword arguments, `inputs_embeds`, gradients, other dtypes or
    devices, or while transformers captures outputs. A prefill of any length is covered."""
    config = model.config
    return not (
        kwargs.keys() - {"output_hidden_states", "output_attentions", "return_dict"}
        or kwargs.get("output_hidden_states")
        or kwargs.get("output_attentions")
        or kwargs.get("return_dict", True) is False
        or input_ids is None
        or inputs_embeds is not None
        or input_ids.dim() != 2
        or input_ids.device.type != "cpu"
        or backend() is None
        or torch.is_grad_enabled()
        or model.embed_tokens.weight.dtype != torch.float32
        or getattr(config, "output_hidden_states", False)
        or getattr(config, "output_attentions", False)
        or getattr(config, "return_dict", True) is False
        or getattr(config, "is_causal", None) is not None
        or tf.attn_implementation(config) not in EXACT_ATTENTIONS
        or (isinstance(attention_mask, dict) and not tf.takes_mask_dict(model))
        or tf.active_output_collector() is not None
    )


def lean_model_forward(
    self: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
):
    """A Llama/Qwen2/Qwen3 base model's forward in the exact mode (see the module docs). A layer with a hook the
    stack cannot serve is called as a module (the stack then steps aside for the whole forward), so every hook runs
    as before; any call it does not cover runs the model's own forward."""
    if not _covered(self, input_ids, attention_mask, inputs_embeds, kwargs):
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
    config = self.config
    use_cache = getattr(config, "use_cache", None) if use_cache is None else use_cache
    hidden_states = self.embed_tokens(input_ids)
    if use_cache and cache is None:
        cache = tf.new_dynamic_cache(config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)
    if isinstance(attention_mask, dict):  # prepared by the caller (Qwen2/Qwen3; every layer is full attention)
        causal_mask = attention_mask["full_attention"]
    else:
        causal_mask = tf.causal_mask(config, hidden_states, attention_mask, cache, position_ids)
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    layers = _run_layers(self, hidden_states, causal_mask, position_embeddings, position_ids, cache, use_cache, kwargs)
    return tf.base_model_output(self.norm(layers), cache)


def _run_layers(self, hidden_states, causal_mask, position_embeddings, position_ids, cache, use_cache, kwargs):
    """The decoder layers of [`lean_model_forward`]: one compiled call when the stack can serve every layer, else
    each lean layer's calls made directly, and any layer with hooks called as a module."""
    compiled = backend()
    cos, sin = position_embeddings
    mask = bool_mask(causal_mask)
    mask = NO_MASK if mask is None else mask
    direct = not tf.global_module_hooks()
    stack = self.__dict__.get(_LEAN_STACK) if direct else None
    out = None if stack is None else _run_stack(stack, compiled, hidden_states, mask, cache, cos, sin)
    if out is not None:
        return out
    for layer in itertools.islice(self.layers, self.config.num_hidden_layers):
        if (
            direct
            and not tf.forward_hooks(layer)
            and not tf.has_forward_pre_hooks(layer)
            and replaced_forward(layer) is lean_layer_forward
        ):
            hidden_states = lean_layer_run(layer, compiled, hidden_states, mask, cache, cos, sin, kwargs)
        else:
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
            )
    return hidden_states


def make_lean_model(model: nn.Module) -> None:
    """Swap a lean-eligible base model's forward for [`lean_model_forward`] and register its layers with the
    compiled layer stack."""
    model.forward = lean_model_forward.__get__(model)
    compiled = backend()
    handle, entries = 0, []
    layers = list(itertools.islice(model.layers, model.config.num_hidden_layers))
    bf16 = lean_bf16(layers[0])  # one `use_kernels` block makes all of a model's layers lean at one precision
    for layer in layers:
        norm_etc, head_counts, post_attention = lean_arguments(layer)
        handle = compiled.stack_add_layer(handle, *norm_etc, *head_counts, *post_attention)
        entries.append((layer, layer.self_attn.layer_idx, head_counts[1], layer.self_attn.head_dim))
    model.__dict__[_LEAN_STACK] = (handle, entries, bf16)


def unmake_lean_model(model: nn.Module) -> None:
    """Undo [`make_lean_model`] and free the compiled stack."""
    stack = model.__dict__.pop(_LEAN_STACK, None)
    compiled = backend()
    if stack is not None and compiled is not None:
        compiled.stack_free(stack[0])
    if is_lean_model(model):
        del model.forward


def _stack_hooks(entries) -> tuple[list[int], list] | None:
    """The output-only hooks the stack hands each layer's output to (`OUTPUT_ONLY_HOOK`, DSpark's feature
    recording), as (layer positions, (hook, layer) pairs); `None` when any layer has another hook or is not on its
    lean forward (transformers' output-capturing hooks are inactive here: nothing is being captured)."""
    record, hooks = [], []
    for i, (layer, _, _, _) in enumerate(entries):
        if tf.has_forward_pre_hooks(layer) or replaced_forward(layer) is not lean_layer_forward:
            return None
        for hook in tf.forward_hooks(layer):
            if getattr(hook, tf.OUTPUT_ONLY_HOOK, False):
                record.append(i)
                hooks.append((hook, layer))
            elif not tf.is_output_capturing_hook(hook):
                return None
    return record, hooks


def _run_stack(stack, compiled, hidden_states, mask, cache, cos, sin) -> torch.Tensor | None:
    """All lean layers of a base model in one compiled call (`stack_run`: each layer's `attn_in`, its keys and
    values written into the cache's buffers, `attn_out`), the same calls as `lean_layer_run` layer by layer, so
    the output and the cache are bit-identical. Returns `None` (run layer by layer instead) for a hook the stack
    cannot serve or a cache that cannot take the new positions in place."""
    handle, entries, bf16 = stack
    hooked = _stack_hooks(entries)
    if hooked is None:
        return None
    record, hooks = hooked
    batch, length, width = hidden_states.shape
    rooms, past = [], 0
    if cache is not None:
        for _, index, heads, dim in entries:
            room = tf.dynamic_layer_room(cache, index, batch, heads, length, dim, hidden_states.dtype)
            if room is None or (rooms and room[3] != past):
                return None
            rooms.append(room)
            past = room[3]
    keys, values = [room[1] for room in rooms], [room[2] for room in rooms]
    flat = hidden_states.reshape(batch * length, width)
    out = compiled.stack_run(handle, flat, cos, sin, mask, batch, length, keys, values, past, record, bf16)
    n = len(rooms)
    for i, (layer, keys_buffer, values_buffer, _) in enumerate(rooms):
        tf.hold_dynamic_layer(layer, keys_buffer, values_buffer, out[1 + i], out[1 + n + i])
    for (hook, layer), output in zip(hooks, out[1 + 2 * n :]):
        hook(layer, (), output)
    return out[0]


def is_lean_model(model: nn.Module) -> bool:
    """Whether a base model (e.g. `LlamaModel`) currently runs the exact mode's [`lean_model_forward`]."""
    return replaced_forward(model) is lean_model_forward


def varlen_stack(model: nn.Module, layer_ids) -> tuple | None:
    """The compiled layer stack of a causal LM's base model when [`run_varlen`] can run it: the model on the lean
    stack (inside `use_kernels` in an exact mode), a plain Llama/Qwen2/Qwen3 causal LM (logits = `lm_head` of the
    final norm), no hooks anywhere, and feature layers `layer_ids` that are inner layers. Else `None`."""
    base = getattr(model, "model", None)
    stack = None if base is None else base.__dict__.get(_LEAN_STACK)
    if stack is None or not is_lean_model(base) or tf.global_module_hooks() or "forward" in model.__dict__:
        return None
    if type(model).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    modules = [model, base, base.embed_tokens, base.norm, base.rotary_emb, model.lm_head]
    modules += [layer for layer, _, _, _ in stack[1]]
    if any(tf.forward_hooks(m) or tf.has_forward_pre_hooks(m) for m in modules):
        return None
    if layer_ids and not all(0 <= int(i) < len(stack[1]) - 1 for i in layer_ids):
        return None
    return stack


def run_varlen(
    model: nn.Module,
    stack,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: list[int],
    pasts: list[int],
    lens: list[int],
    buffers,
    keep_rows: torch.Tensor,
    layer_ids,
) -> tuple:
    """One forward of a causal LM on packed rows with no padding: `ids` / `positions` `[N]` are the new tokens of
    sequences one after another (sequence `s`: `lens[s]` tokens at positions `pasts[s]..`, its keys and values in
    slot `slots[s]` of `buffers`, one `(keys, values)` `[slots, kv_heads, capacity, head_dim]` per layer, written
    in place). Returns `(logits [len(keep_rows), V], features [N, m·d] or None)`: the logits of the packed rows
    `keep_rows`, the concatenated outputs of layers `layer_ids`. Every operation is per row or per query
    (`stack_run_varlen`), so a sequence's rows are bit-identical to the same tokens in the model's own forward on
    the exact kernels, whatever else is packed beside them."""
    base = model.model
    handle, _, bf16 = stack
    x = base.embed_tokens(ids)  # [N, W]
    cos, sin = base.rotary_emb(x[None], positions[None])
    record = [int(i) for i in layer_ids] if layer_ids else []
    keys, values = [k for k, _ in buffers], [v for _, v in buffers]
    out = backend().stack_run_varlen(handle, x, cos[0], sin[0], slots, pasts, lens, keys, values, record, bf16)
    hidden = base.norm(out[0][None])[0]
    logits = model.lm_head(hidden[keep_rows][None])[0]
    by_layer = dict(zip(sorted(record), out[1:]))  # the stack returns them in layer order
    features = torch.cat([by_layer[i] for i in record], dim=-1) if record else None
    return logits, features
