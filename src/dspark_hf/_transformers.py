"""Every use of transformers' private or version-dependent API, in one place (`tests/kernels/test_transformers_api.py`
checks each against the installed release).

Here too, in its own section at the end, the mechanics of the `generate()` hook (`GenerationMixin.
_get_candidate_generator` with its signature guard, and the thin `generate` wrapper), which
`dspark_hf.decoding.generation` fills with DSpark's candidate generator; and:

* which hidden states to ask for, and the `+1` offset of `hidden_states` (index 0 is the embeddings), with the
  version gate for selecting them by index; where the decoder layers are, to record the wanted layers' outputs
  with hooks of our own ([`recording_layers`]);
* a generation config's end-of-sequence ids (`_eos_token_tensor`, filled in by `generate()`);
* the name of the cache keyword of a model's `forward` (`cache` in newer releases, `past_key_values` before),
  cached per model class;
* a `DynamicCache` built around existing tensors without copying them (its layers' `keys`/`values`), and a
  cache whose layers write into the engine's preallocated slots in place (`DynamicLayer.update`'s contract);
* dropping a model's quantizer after dequantising it (`hf_quantizer`);
* a config's provenance (`name_or_path`, `_commit_hash`);
* the target's CPU kernels (`dspark_hf.kernels`), in their own section: the attention implementation and its
  registry, transformers' output collector and capturing hooks, torch's module hooks, the Llama/Qwen2/Qwen3 layer and
  model classes, the causal mask and base-model output, and growing a `DynamicLayer` in place.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import transformers
from packaging import version

#: Selecting hidden states by index (unselected ones come back as `None`) saves memory; older releases only
#: accept a bool.
HIDDEN_STATES_BY_INDEX = version.parse(transformers.__version__) >= version.parse("5.23.0")


def hidden_state_indices(layer_ids: Sequence[int]) -> list[int]:
    """Positions in transformers' `output_hidden_states` tuple of the target layers `layer_ids`.

    Entry 0 of that tuple is the embedding output and entry `l + 1` the output of decoder layer `l`, so a layer
    id maps to `l + 1` and the embedding output (`-1`, as in DeepSpec) to 0. Every driver (generation, engine,
    training features) reads the target's hidden states through this one function.
    """
    return [int(i) + 1 for i in layer_ids]


def hidden_states_request(layer_ids: Sequence[int]) -> list[int] | bool:
    """The `output_hidden_states` value that returns the outputs of the target layers `layer_ids`."""
    return hidden_state_indices(layer_ids) if HIDDEN_STATES_BY_INDEX else True


def selected_hidden_states(hidden_states: Sequence[Any], layer_ids: Sequence[int]):
    """The outputs of decoder layers `layer_ids`, concatenated on the last dimension: `[B, T, m·d]`.

    `hidden_states[0]` is the embedding output, so layer `i`'s output is `hidden_states[i + 1]`.
    """
    import torch

    return torch.cat([hidden_states[i] for i in hidden_state_indices(layer_ids)], dim=-1)


def decoder_layers(model) -> Any:
    """The decoder layers (`nn.ModuleList`) of a transformers causal LM (`model.model.layers`, or a multimodal
    model's `model.language_model.layers`), or `None` when the model is laid out otherwise."""
    import torch

    base = getattr(model, "model", None)
    for holder in (base, getattr(base, "language_model", None)):
        layers = getattr(holder, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    return None


#: An attribute a forward hook may carry to say that it only reads the layer's output (and returns `None`); the
#: exact mode's one-call layer stack (`dspark_hf.kernels.lean_model`) then hands it the output instead of stepping aside.
OUTPUT_ONLY_HOOK = "_dspark_output_only"


class LayerRecorder:
    """Forward hooks on decoder layers `layer_ids` that keep each layer's latest output (see [`recording_layers`])."""

    def __init__(self, layers, layer_ids: Sequence[int]) -> None:
        self.layer_ids = [int(i) for i in layer_ids]
        self.outputs: dict[int, Any] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in dict.fromkeys(self.layer_ids)]

    def _hook(self, index: int):
        def hook(module, inputs, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output

        setattr(hook, OUTPUT_ONLY_HOOK, True)  # reads the output only: the exact mode's layer stack may call it
        return hook

    def features(self):
        """The wanted layers' outputs of the latest forward, concatenated on the last dimension (`[B, T, m·d]`)."""
        import torch

        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.outputs = [], {}


def can_record(model, layer_ids: Sequence[int]) -> bool:
    """Whether [`recording_layers`] can hook every layer of `layer_ids` (inner decoder layers of a known layout)."""
    layers = decoder_layers(model)
    return layers is not None and all(0 <= int(i) < len(layers) - 1 for i in layer_ids)


@contextlib.contextmanager
def recording_layers(model, layer_ids: Sequence[int] | None):
    """Record the outputs of decoder layers `layer_ids` of every forward inside the block; yields a
    [`LayerRecorder`], or `None` when they cannot be hooked (no `layer_ids`, a model laid out otherwise, the
    embedding output `-1`, or the last layer, whose transformers entry may be taken after the final norm: ask
    for `output_hidden_states` then).

    Why not `output_hidden_states`: asking transformers for it installs its output-capturing hooks on *every*
    decoder layer and attention module for good, which costs ~3% of a one-token forward of a 30-layer model
    (measured on SmolLM2-135M: 27.6 vs 26.7 ms) in every later forward, features wanted or not. One hook per
    wanted layer, removed at the end of the block, costs nothing measurable.
    """
    if not layer_ids or not can_record(model, layer_ids):
        yield None
        return
    recorder = LayerRecorder(decoder_layers(model), layer_ids)
    try:
        yield recorder
    finally:
        recorder.remove()


def forward_with_features(model, layer_ids: Sequence[int] | None, *args, **kwargs):
    """`model(*args, **kwargs)` and the outputs of decoder layers `layer_ids` concatenated (`[B, T, m·d]`,
    as [`selected_hidden_states`]), or `None` without `layer_ids`. Returns `(output, features)`; the features
    are recorded with [`recording_layers`] where it can, else read from `output_hidden_states`."""
    if not layer_ids:
        return model(*args, **kwargs), None
    with recording_layers(model, layer_ids) as recorder:
        if recorder is None:
            out = model(*args, output_hidden_states=hidden_states_request(layer_ids), **kwargs)
            return out, selected_hidden_states(out.hidden_states, layer_ids)
        out = model(*args, **kwargs)
        return out, recorder.features()


def eos_token_ids(generation_config) -> set[int]:
    """End-of-sequence ids of a `GenerationConfig` (public `eos_token_id`, else the tensor `generate()` fills in).

    Read from the public field first so that no device tensor has to be read back.
    """
    eos = generation_config.eos_token_id
    if eos is None:
        tensor = getattr(generation_config, "_eos_token_tensor", None)
        return set(tensor.reshape(-1).tolist()) if tensor is not None else set()
    return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def forward_accepts(model, name: str) -> bool:
    """Whether `model.forward` takes a keyword `name` (signature read once per model class)."""
    return name in _forward_parameters(type(model))


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (the old name warns in 5.24)."""
    return "cache" if forward_accepts(model, "cache") else "past_key_values"


def filled_cache(data):
    """A `DynamicCache` holding `data` (one `(keys, values)` per layer) without copying it.

    `DynamicCache(ddp_cache_data=...)` would concatenate every tensor onto an empty one (a full copy of the
    batch's KV each round); handing the tensors to the layers directly avoids that. Falls back to the
    copying constructor if a transformers release stores layer tensors differently.
    """
    from transformers import DynamicCache

    if not data:
        return DynamicCache()
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in data])
    for layer, (k, v) in zip(cache.layers, data):
        layer.keys, layer.values = k, v
    if cache.get_seq_length() != data[0][0].shape[-2]:
        return DynamicCache(ddp_cache_data=data)
    return cache


def slot_cache(buffers, index, kv_len: int):
    """A cache that writes a forward's new keys/values into preallocated buffers, each row at its own positions.

    Layer `i` receives the forward's keys/values `[R, kv_heads, n, head_dim]`, scatters them into `buffers[i]`
    (whole-capacity views `[R, kv_heads, C, head_dim]` of the engine's slots) at the columns `index` (`[R, n]`,
    row `r`'s new tokens at `length_r + j`), and attends over the views `[:, :, :kv_len]`. The caller's mask
    decides what each query sees, so columns past a row's own tokens (another row's longer past, stale
    rejected drafts) are never read. Built on transformers' `Cache(layers=...)` with `DynamicLayer` as base
    (its `update` contract: return the keys/values to attend over).
    """
    from transformers.cache_utils import Cache

    return Cache(layers=[_SlotLayer(k, v, index, kv_len) for k, v in buffers])


@functools.cache
def _slot_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):
        def __init__(self, keys, values, index, kv_len):
            super().__init__()
            self.buf_keys, self.buf_values, self.kv_len = keys, values, kv_len
            shape = (keys.shape[0], keys.shape[1], index.shape[1], keys.shape[3])
            self.scatter_index = index[:, None, :, None].expand(shape)
            self.keys, self.values = keys[:, :, :kv_len], values[:, :, :kv_len]
            self.is_initialized = True
            self.device = keys.device

        def update(self, key_states, value_states, *args, **kwargs):
            self.buf_keys.scatter_(2, self.scatter_index, key_states.to(self.buf_keys.dtype))
            self.buf_values.scatter_(2, self.scatter_index, value_states.to(self.buf_values.dtype))
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.kv_len - self.scatter_index.shape[2]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.kv_len, 0

    return SlotLayer


def _SlotLayer(keys, values, index, kv_len):  # noqa: N802 - builds the lazily defined layer class
    return _slot_layer_class()(keys, values, index, kv_len)


def cache_layer_kv(cache, layer: int):
    """`(keys, values)` of one layer of a `DynamicCache` (after a forward appended to it)."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def drop_quantizer(model) -> None:
    """Forget a model's quantizer once its weights are dequantised (so `save_pretrained`/`.to()` treat it as
    an ordinary model)."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def model_name(model_or_config) -> str:
    """The model's name or path (`config.name_or_path`, public), else its class name."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "name_or_path", "") or type(model_or_config).__name__


def commit_hash(config) -> str | None:
    """The Hub revision a config was loaded from, when transformers recorded it."""
    return getattr(config, "_commit_hash", None)


# ------------------------------------------------------------------------ the generate() hook (dspark_hf.decoding.generation)
# transformers' assisted decoding picks its candidate generator in the private `_get_candidate_generator`, an
# if/elif chain with no registry; a third-party drafter has to wrap it. The wrapping lives here, signature-guarded
# and pinned by `tests/kernels/test_transformers_contract.py`; what DSpark does inside it lives in decoding/generation.py.

#: The parameters of `GenerationMixin._get_candidate_generator` the hook was written against.
EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS = (
    "self",
    "generation_config",
    "input_ids",
    "inputs_tensor",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
    "target_tokenizer",
    "assistant_tokenizer",
)


def check_candidate_generator_signature(method=None) -> None:
    """Raise `RuntimeError` when `GenerationMixin._get_candidate_generator` (or `method`) no longer has the
    parameters the hook was written against."""
    from transformers import GenerationMixin

    method = method if method is not None else original_candidate_generator_factory()
    params = tuple(inspect.signature(method).parameters)
    if params != EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS:
        raise RuntimeError(
            f"dspark_hf cannot hook into this transformers release: {GenerationMixin.__name__}._get_candidate_generator "
            f"has parameters {params}, expected {EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS}. Please report this with "
            f"your transformers version ({transformers.__version__})."
        )


def original_candidate_generator_factory():
    """transformers' own `GenerationMixin._get_candidate_generator` (unwrapped)."""
    from transformers import GenerationMixin

    method = GenerationMixin._get_candidate_generator
    return getattr(method, "_dspark_original", method)


def hook_candidate_generator(make) -> None:
    """Wrap `GenerationMixin._get_candidate_generator` once (idempotent): `make(model, generation_config,
    input_ids, logits_processor, assistant_model)` returns a candidate generator, or `None` to leave the call to
    transformers' own choice, which then runs with exactly its original arguments."""
    from transformers import GenerationMixin

    original = GenerationMixin._get_candidate_generator
    if getattr(original, "_dspark_wrapped", False):
        return
    check_candidate_generator_signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model=None,
        target_tokenizer=None,
        assistant_tokenizer=None,
    ):
        generator = make(self, generation_config, input_ids, logits_processor, assistant_model)
        if generator is not None:
            return generator
        return original(
            self,
            generation_config,
            input_ids,
            inputs_tensor,
            logits_processor,
            model_kwargs,
            assistant_model,
            target_tokenizer,
            assistant_tokenizer,
        )

    _get_candidate_generator._dspark_wrapped = True
    _get_candidate_generator._dspark_original = original
    GenerationMixin._get_candidate_generator = _get_candidate_generator


def hook_generate(wrapper) -> None:
    """Wrap the public `GenerationMixin.generate` once (idempotent): every call becomes
    `wrapper(original_generate, model, *args, **kwargs)`."""
    from transformers import GenerationMixin

    original = GenerationMixin.generate
    if getattr(original, "_dspark_original", None) is not None:
        return

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    generate._dspark_original = original
    GenerationMixin.generate = generate


# ------------------------------------------------------------------------ the target's CPU kernels (dspark_hf.kernels)
# The exact kernel mode swaps the forwards of transformers' Llama-family layers and base models for compiled calls.
# Everything it needs to know about transformers' (and torch's module-hook) internals is asked here, one helper per
# question, each pinned by `tests/kernels/test_transformers_api.py`.

#: What [`active_output_collector`] returns on a release that keeps its output collector elsewhere.
UNKNOWN_COLLECTOR = "unknown"


def attn_implementation(model_or_config) -> str | None:
    """The attention implementation a model (or config) runs: `"sdpa"`, `"eager"`, a registered name, or `None`."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "_attn_implementation", None)


def supports_attention_backend(model) -> bool:
    """Whether `model` routes its attention through transformers' `AttentionInterface`, so that
    `set_attn_implementation` can switch it to a registered function (a DSpark draft calls its own attention)."""
    return bool(getattr(model, "_supports_attention_backend", False)) and hasattr(model, "set_attn_implementation")


def register_attention(name: str, function) -> None:
    """Register `function` as attention implementation `name` (once), with the boolean SDPA-style mask maker."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if name in AttentionInterface._global_mapping:
        return
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)  # boolean masks (or None: plain causal)


def sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """transformers' own SDPA attention function (the stock path an attention implementation can step aside to)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def active_output_collector():
    """transformers' output collector of the forward running now (`None` outside any output capture), or
    [`UNKNOWN_COLLECTOR`] on a release that keeps it elsewhere (callers then treat every forward as capturing)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return UNKNOWN_COLLECTOR
    return _active_collector.get()


def is_output_capturing_hook(hook) -> bool:
    """Whether a forward hook is transformers' own output-capturing hook (installed for good on the first
    `output_hidden_states=True` or `output_attentions=True` call; on an attention module it only records attention
    weights)."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def forward_hooks(module) -> list:
    """The forward hooks registered on one module (torch keeps them in a private dict)."""
    return list(module._forward_hooks.values())


def has_forward_pre_hooks(module) -> bool:
    """Whether one module has forward pre-hooks."""
    return bool(module._forward_pre_hooks)


def global_module_hooks() -> bool:
    """Whether torch has global forward (pre-)hooks, which run around every module call."""
    import torch

    return bool(torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)


@functools.cache
def lean_layer_types() -> dict[type, tuple[type, type]]:
    """transformers' decoder layers whose forward is pre-norm attention + SwiGLU MLP with RMSNorm (Qwen3 adds a
    per-head RMSNorm on queries and keys): layer class → (its attention class, its RMSNorm class)."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    return {
        llama.LlamaDecoderLayer: (llama.LlamaAttention, llama.LlamaRMSNorm),
        qwen2.Qwen2DecoderLayer: (qwen2.Qwen2Attention, qwen2.Qwen2RMSNorm),
        qwen3.Qwen3DecoderLayer: (qwen3.Qwen3Attention, qwen3.Qwen3RMSNorm),
    }


@functools.cache
def lean_model_types() -> tuple[type, ...]:
    """The base models (`LlamaModel`, `Qwen2Model`, `Qwen3Model`) whose forward the exact mode reproduces."""
    from transformers import LlamaModel, Qwen2Model, Qwen3Model

    return (LlamaModel, Qwen2Model, Qwen3Model)


def takes_mask_dict(model) -> bool:
    """Whether `model`'s forward takes an attention-mask dict prepared by its caller (`Qwen2Model`/`Qwen3Model`,
    which have sliding-window variants; `LlamaModel` builds its mask itself)."""
    from transformers import LlamaModel

    return type(model) is not LlamaModel


def base_output_has_cache() -> bool:
    """Whether a base model's output (`BaseModelOutputWithPast`) names its cache field `cache`."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" in BaseModelOutputWithPast.__dataclass_fields__


def base_model_output(last_hidden_state, cache):
    """A base model's output (`BaseModelOutputWithPast`) with only the last hidden state and the cache."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=last_hidden_state, cache=cache)


def new_dynamic_cache(config):
    """An empty `DynamicCache` for a model of `config`."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def causal_mask(config, inputs_embeds, attention_mask, cache, position_ids):
    """transformers' causal mask for a forward (`None` where the attention implementation needs none)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )


# A `DynamicLayer` appends by `torch.cat`, copying the layer's whole cache on every forward. The helpers below let the
# exact mode write only the new positions into buffers with room to grow (capacity doubling) and make the layer's
# `keys`/`values` views of them: what the layer holds, and what attention reads, stays the same.
_KV_BUFFERS = "_dspark_kv_buffers"  # on a DynamicLayer: (keys buffer, values buffer, keys view, values view)


def dynamic_layer_room(cache, index: int, batch: int, heads: int, new: int, dim: int, dtype):
    """`(layer, keys buffer, values buffer, n)` for appending `new` positions to layer `index` of `cache` in place
    at position `n` (its current length), or `None` when the cache must update the layer itself: another cache or
    layer type (the engine's slot caches, sliding windows, offloading), a layer not filled yet, other shapes. A
    layer whose tensors were replaced since the last write (a crop, a beam reorder) gets a fresh buffer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers) or getattr(cache, "offloading", False):
        return None
    layer = layers[index]
    if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys.dim() != 4:
        return None
    held_k, held_v, n = layer.keys, layer.values, layer.keys.shape[2]
    buffers = layer.__dict__.get(_KV_BUFFERS)
    if buffers is not None and held_k is buffers[2] and held_v is buffers[3]:
        fits = True  # the very views set last time: only room and shape to check
    else:
        fits = (
            buffers is not None
            and (held_k.data_ptr(), held_v.data_ptr()) == (buffers[0].data_ptr(), buffers[1].data_ptr())
            and (held_k.stride(), held_v.stride()) == (buffers[0].stride(), buffers[1].stride())
        )
    if fits and n + new <= buffers[0].shape[2] and buffers[0].shape[0] == batch:
        if (buffers[0].shape[1], buffers[0].shape[3], buffers[0].dtype) == (heads, dim, dtype):
            return layer, buffers[0], buffers[1], n
    if n and (held_k.shape != (batch, heads, n, dim) or held_v.shape != held_k.shape or held_k.dtype != dtype):
        return None
    capacity = max(256, 2 * (n + new))
    keys_buffer = held_k.new_empty(batch, heads, capacity, dim, dtype=dtype)
    values_buffer = held_k.new_empty(batch, heads, capacity, dim, dtype=dtype)
    if n:
        keys_buffer.narrow(2, 0, n).copy_(held_k)
        values_buffer.narrow(2, 0, n).copy_(held_v)
    return layer, keys_buffer, values_buffer, n


def hold_dynamic_layer(layer, keys_buffer, values_buffer, keys, values) -> None:
    """Make `keys`/`values` (views of the buffers' first positions) the `DynamicLayer`'s cache."""
    layer.keys, layer.values = keys, values
    layer.__dict__[_KV_BUFFERS] = (keys_buffer, values_buffer, keys, values)


def grow_dynamic_layer(cache, index: int, keys, values, kwargs: dict):
    """`cache.update(keys, values, index)` for a plain `DynamicLayer`, without its concatenation: the new
    positions are written into the layer's buffers ([`dynamic_layer_room`]); any other layer goes through the
    cache's own `update`. Returns the keys and values to attend over, as `update` does."""
    batch, heads, new, dim = keys.shape
    room = dynamic_layer_room(cache, index, batch, heads, new, dim, keys.dtype) if values.shape == keys.shape else None
    if room is None:
        return cache.update(keys, values, index, kwargs=kwargs)
    layer, keys_buffer, values_buffer, n = room
    keys_buffer.narrow(2, n, new).copy_(keys)
    values_buffer.narrow(2, n, new).copy_(values)
    hold_dynamic_layer(
        layer, keys_buffer, values_buffer, keys_buffer.narrow(2, 0, n + new), values_buffer.narrow(2, 0, n + new)
    )
    return layer.keys, layer.values
