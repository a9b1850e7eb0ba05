"""Kernel modes for the target's forward on a CPU: `"stock"`, `"packed"` and `"exact"`.

Speculative decoding verifies `k` drafted tokens in one forward of the target. What "lossless" can promise
depends on the kernels that forward runs on:

- `"stock"`: PyTorch's own kernels, untouched. A k-row forward rounds differently from k one-row forwards
  (the matrix product switches from a matrix-vector kernel to a blocked one), so speculative greedy output
  equals plain decoding's only as long as no near-tie of two logits is decided differently; this is an
  empirical property, not a guarantee.
- `"packed"`: oneDNN packed weights for every linear layer ([`packed_linears`]). Faster, but its rows are not
  batch-invariant either.
- `"exact"`: batch-invariant kernels. Every row of a k-row forward is computed by the same sequence of
  floating-point operations as a one-row forward: the linear layers (LM head included) and the attention over
  the KV cache run on small fixed-order kernels ([`exact_kernels_backend`]). Speculative decoding in this mode
  is token-identical to plain decoding *in the same mode* by construction (greedy), and samples from exactly
  the distribution plain decoding in this mode samples from.

[`use_kernels`] switches a target (and optionally its draft) to a mode for a `with` block;
`generate(..., dspark_kernels="exact")` does it for one call, plain or speculative, and [`set_kernels`] sets
the mode every `generate()` call uses.

The exact kernels are a C++ extension built with `torch.utils.cpp_extension` at first use (about a minute;
it needs a C++ compiler and `ninja`) and cached under `$TORCH_EXTENSIONS_DIR` or
`$DSPARK_HF_CACHE/torch_extensions`. Without a compiler a pure-PyTorch fallback computes each row with its
own one-row call (identical by construction, slower).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import os
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from .._paths import cache_dir
from .._transformers import OUTPUT_ONLY_HOOK
from .cpu_packing import cpu_packing_enabled, is_packed, packed_linears, packing_available

KERNEL_MODES = ("stock", "packed", "exact")

#: The attention implementation name registered with transformers' `AttentionInterface` for the exact mode.
EXACT_ATTENTION = "dspark_exact"

#: Forwards whose sequences are longer than this many tokens (the prefill of a long prompt) run on the stock
#: kernels in the exact mode; everything else runs on the exact kernels: every decoding and verification
#: forward, and the prefill of any prompt up to this length, so that the whole computation of such a prompt
#: (its KV cache included) is the same whether it runs alone in plain `generate()` or batched in the engine.
#: The limit is per sequence, not per forward (32 sequences verifying 4 tokens each are 128 rows, all exact).
#: What exactness costs a prefill of SmolLM2-135M on a 2-core CPU (benchmarks/bench_batched_forward.py
#: --prefill): 64 tokens 0.8x stock's time, 128 1.1x, 256 and 512 1.3x, 1024 1.75x, 2048 2.3x (the exact
#: attention visits one query at a time); 512 keeps the guarantee for ordinary prompts at a bounded cost.
EXACT_MAX_ROWS = 512

_MODE: str | None = None  # set_kernels(); None: environment / legacy packing flag / "stock"
_EXACT_FLAG = "_dspark_exact_mode"  # set on every module of a model inside exact_kernels(); read by mode_linear
_BACKEND: object | None = None  # the compiled extension, or False when it could not be built
_BUILD_LOCK = threading.Lock()
_LEAN_ARGS = "_dspark_lean_arguments"  # set on a layer while it runs the lean path
_NO_MASK = torch.empty(0, dtype=torch.bool)  # the attention kernel's "causal over the cache"


def _check_mode(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"Unknown kernel mode {mode!r}; choose one of {', '.join(repr(m) for m in KERNEL_MODES)} "
            "(see dspark_hf.model.kernels)."
        )
    return mode


def set_kernels(mode: str | None) -> None:
    """Set the kernel mode that `generate()` uses for plain and speculative decoding (`None`: back to the default).

    The default is `"stock"` (or the environment variable `DSPARK_KERNELS`; `DSPARK_CPU_PACKING=1` and
    [`set_cpu_packing`] still select `"packed"` for speculative calls). Once a mode is set here or in the
    environment, plain `generate()` calls run on it too, so both decoding paths share the same kernels.
    """
    global _MODE
    _MODE = None if mode is None else _check_mode(mode)


def explicit_kernels() -> str | None:
    """The mode set with [`set_kernels`] or `DSPARK_KERNELS`, or `None` when neither is set."""
    if _MODE is not None:
        return _MODE
    env = os.environ.get("DSPARK_KERNELS", "").strip().lower()
    if env:
        try:
            return _check_mode(env)
        except ValueError as err:
            raise ValueError(f"DSPARK_KERNELS={env!r}: {err}") from None
    return None


def default_kernels() -> str:
    """The mode speculative `generate()` uses when the call names none (see [`set_kernels`])."""
    mode = explicit_kernels()
    if mode is not None:
        return mode
    return "packed" if cpu_packing_enabled() else "stock"


def recommended_kernels(model: nn.Module) -> str:
    """The mode the command-line tools and the server run `model` on when told none: the mode set with
    [`set_kernels`] or `DSPARK_KERNELS` if any, else `"exact"` for float32 weights on the CPU (batch-invariant
    and, on the CPUs measured, faster than stock at every batch size decoding uses), else `"stock"` (the exact
    kernels are CPU float32 kernels; other dtypes would run their slow per-row fallback)."""
    mode = explicit_kernels()
    if mode is not None:
        return mode
    weight = next((p for p in model.parameters() if p.dim() == 2), None)
    on_cpu_fp32 = weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
    return "exact" if on_cpu_fp32 else "stock"


def kernels_of(model: nn.Module) -> str:
    """Which mode `model` currently runs in: `"exact"`, `"packed"` or `"stock"`."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == EXACT_ATTENTION:
        return "exact"
    for module in model.modules():
        if is_exact(module):
            return "exact"
        if is_packed(module):
            return "packed"
    return "stock"


# ---------------------------------------------------------------------------------------------- the backend
def _extensions_dir() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else cache_dir() / "torch_extensions"


def _build_flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    if capability == "AVX512":
        # the same 8-lane arithmetic, with AVX-512VL's 32 vector registers: a verification forward of up to 8 rows
        # then reads each weight tile once (exact_kernels.cpp, rows_tile)
        flags += ["-mavx512f", "-mavx512vl"]
    return flags


def _build():
    from torch.utils import cpp_extension

    try:  # the `ninja` package's binary, in case its folder is not on PATH (a venv that is not activated)
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    source = (Path(__file__).with_name("exact_kernels.cpp")).read_text()
    flags = _build_flags()
    key = hashlib.sha256("\n".join([source, *flags, torch.__version__, sys.version]).encode()).hexdigest()[:12]
    name = f"dspark_exact_{key}"
    folder = _extensions_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(
        name=name,
        cpp_sources=[source],
        functions=[
            "linear",
            "attention",
            "rms_norm",
            "rope",
            "silu_mul",
            "attn_in",
            "attn_out",
            "stack_add_layer",
            "stack_free",
            "stack_run",
            "draft_ingest",
            "draft_block_run",
            "markov_greedy",
        ],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def _backend():
    """The compiled extension, built on first use; `None` when it cannot be built (then the fallback runs)."""
    global _BACKEND
    if _BACKEND is None:
        with _BUILD_LOCK:
            if _BACKEND is None:
                if os.environ.get("DSPARK_EXACT_BACKEND", "").strip().lower() == "torch":
                    _BACKEND = False
                else:
                    try:
                        _BACKEND = _build()
                    except Exception as err:  # no compiler, no ninja, a read-only cache ...
                        warnings.warn(
                            f"dspark_hf could not build its exact CPU kernels ({type(err).__name__}: {err}); the "
                            "exact kernel mode uses its pure-PyTorch fallback, which is exact but slower. Install a "
                            "C++ compiler and `pip install ninja` to get the fast kernels.",
                            stacklevel=3,
                        )
                        _BACKEND = False
    return _BACKEND or None


def exact_kernels_backend() -> str:
    """Which implementation the exact mode runs: `"cpp"` (the compiled kernels) or `"torch"` (the fallback).

    Builds the kernels on first call. Set `DSPARK_EXACT_BACKEND=torch` to force the fallback.
    """
    return "cpp" if _backend() is not None else "torch"


def exact_kernels_build() -> str:
    """Which build of the exact kernels runs: `"cpp-<key>"` (a hash of the C++ source, the compiler flags and the
    torch and Python versions) or `"torch"` (the fallback). Cost measurements taken on the exact kernels (the SPS
    profile) record it, so that a kernel change invalidates them."""
    backend = _backend()
    if backend is None:
        return "torch"
    return "cpp-" + backend.__name__.removeprefix("dspark_exact_")  # the key _build named the extension with


def build_exact_kernels() -> str:
    """Build (or load from the cache) the exact kernels now rather than on first use; returns the backend name."""
    return exact_kernels_backend()


# ---------------------------------------------------------------------------------------------- linears
def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` with every row of `x` computed exactly as it would be alone (batch-invariant).

    Float32 CPU tensors run on the compiled kernel; anything else (and every input when the kernel is not
    available) runs one `torch.nn.functional.linear` call per row, which is row-invariant by construction.
    """
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    backend = _backend()
    if backend is not None and rows.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        out = backend.linear(rows, weight.detach(), None if bias is None else bias.detach())
    elif rows.shape[0] == 1:
        out = F.linear(rows, weight, bias)
    else:
        out = torch.cat([F.linear(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
    return out.reshape(*lead, weight.shape[0])


def mode_linear(
    owner: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a functional linear inside `owner`, on `owner`'s kernels: [`exact_linear`]
    while `owner` runs in the exact mode (inside [`exact_kernels`]), `F.linear` otherwise.

    The draft's LM-head rows and its Markov head's output projection are functional linears (they use cached
    weight slices, not `nn.Linear` modules), so switching the modules alone leaves them on the stock kernel,
    whose 2-16-row GEMM path re-packs the weight on every call: ~3.5x the exact kernel's time for the
    8,192-row draft LM head on 7 rows (measured on the 2-core CPU of docs/cpu-packing.md). Only speed changes
    for a draft: its tokens are verified either way.
    """
    if (
        owner.__dict__.get(_EXACT_FLAG, False)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return exact_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _eligible(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear  # subclasses (quantised, LoRA-wrapped ...) keep their own forward
        and "forward" not in module.__dict__  # already hooked (accelerate offload, packing)
        and isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.layout == torch.strided
    )


def _sequence_length(x: torch.Tensor) -> int:
    """Tokens per sequence of a linear layer's input: `[..., L, K]` (a 2-D `[M, K]` input counts as one sequence)."""
    return x.shape[-2] if x.dim() >= 2 else 1


def _exact_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (
        x.device.type != "cpu"
        or x.dtype != self.weight.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        or _sequence_length(x) > EXACT_MAX_ROWS
    ):
        return nn.Linear.forward(self, x)
    return exact_linear(x, self.weight, self.bias)


def _replaced_forward(module: nn.Module):
    """The function behind an instance-bound replacement of `module.forward` (one of this module's), or `None`."""
    return getattr(module.__dict__.get("forward"), "__func__", None)


def is_exact(module: nn.Module) -> bool:
    """Whether `module` (an `nn.Linear`) currently runs on the exact kernel."""
    return _replaced_forward(module) is _exact_forward


def _draft_norm_eligible(module: nn.Module) -> bool:
    """A DSpark draft's own (Qwen3-style) RMSNorm with fp32 CPU weights and no hooks."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "RMSNorm"
        and type(module).__module__ == "dspark_hf.model.layers"
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and _plain(module)
    )


def _exact_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A DSpark draft's RMSNorm on the compiled `rms_norm` (the one the lean layers and the compiled drafting round
    use), so that the draft's PyTorch-level path and its compiled round compute the same values. Only the draft's
    speed and its exact bits change: its proposals are verified either way."""
    backend = _backend()
    if (
        backend is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
    ):
        return type(self).forward(self, x)
    return backend.rms_norm(x.reshape(-1, x.shape[-1]), self.weight.detach(), self.eps).view(x.shape)


def _check_attention_options(module: nn.Module, dropout: float, kwargs: dict) -> None:
    for name in ("s_aux", "sinks", "softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"The exact kernel mode does not support attention with `{name}` (model "
                f"{type(module).__name__}); use kernels='stock' or 'packed' for this model."
            )
    if dropout and module.training:
        raise NotImplementedError("The exact kernel mode is for inference; attention dropout is not supported.")


def _bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' attention mask as booleans (true = may attend); an additive float mask allows what is finite."""
    if mask is not None and mask.dtype != torch.bool:
        mask = torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min)
    return mask


# ---------------------------------------------------------------------------------------------- attention
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
    _check_attention_options(module, dropout, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = _bool_mask(attention_mask)
    if query.shape[2] > EXACT_MAX_ROWS:  # a prefill: the same call in plain and speculative decoding
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    backend = _backend()
    if backend is not None and query.dtype == key.dtype == value.dtype == torch.float32 and query.device.type == "cpu":
        empty = torch.empty(0, dtype=torch.bool)
        return backend.attention(query, key, value, empty if mask is None else mask, float(scale)), None
    return _attention_fallback(query, key, value, mask, scale), None


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


def _register_attention() -> None:
    from transformers import AttentionInterface

    if EXACT_ATTENTION in AttentionInterface._global_mapping:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
    AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)  # boolean masks (or None: plain causal)


# ---------------------------------------------------------------------------------------------- decoder layers
#: Decoder layers the exact mode runs through [`_lean_layer_forward`]: transformers' Llama-family layers whose
#: forward is pre-norm attention + SwiGLU MLP with RMSNorm (Qwen3 adds a per-head RMSNorm on queries and keys).
LEAN_LAYERS = {
    "LlamaDecoderLayer": "LlamaAttention",
    "Qwen2DecoderLayer": "Qwen2Attention",
    "Qwen3DecoderLayer": "Qwen3Attention",
}
_LEAN_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _output_capturing(hook) -> bool:
    """transformers' own output-capturing hook (installed for good on the first `output_hidden_states=True` or
    `output_attentions=True` call): on an attention module it only records attention weights, which the exact
    attention never returns, so bypassing that module's call loses nothing."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _plain(module: nn.Module, capturing_ok: bool = False) -> bool:
    """No hooks and no replaced forward (ours excepted): calling its kernels directly skips nothing."""
    hooks = list(module._forward_hooks.values())
    return (
        all(capturing_ok and _output_capturing(h) for h in hooks)
        and not module._forward_pre_hooks
        and ("forward" not in module.__dict__ or is_exact(module))
    )


def _lean_eligible(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in LEAN_LAYERS or "forward" in layer.__dict__ or attn is None or mlp is None:
        return False
    if type(attn).__name__ != LEAN_LAYERS[type(layer).__name__] or getattr(attn, "sliding_window", None) is not None:
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return (
        getattr(attn.config, "hidden_act", None) == "silu"
        and all(type(n).__name__ in _LEAN_NORMS and hasattr(n, "variance_epsilon") for n in norms)
        and all((_eligible(lin) or is_exact(lin)) and lin.weight.dtype == torch.float32 for lin in linears)
        and _plain(attn, capturing_ok=True)
        and all(_plain(m) for m in [mlp, *norms, *linears])
    )


def _lean_layer_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """A Llama-family decoder layer in the exact mode, as one short sequence of exact-kernel calls.

    The same arithmetic as transformers' layer (pre-norm attention with rotary embeddings, then the SwiGLU MLP,
    residuals around both) with every per-row operation on the compiled kernels: RMSNorm, the seven linears,
    rotary embedding, attention over the cache and the SiLU gate. Each row is computed exactly as it would be
    alone, like the rest of the exact mode. The layer is two compiled calls around the KV cache's update
    (`attn_in`: norm, q/k/v in one parallel region, rotation; `attn_out`: attention, output projection and
    residual, norm, gate/up in one region, SiLU gate, down projection and residual), bit-identical to calling
    the kernels one by one: skipping ~40 small PyTorch operations, eight module calls and five of seven
    fork/joins per layer is most of what a one-token forward of a small model spends outside its matrix
    products (SmolLM2-135M, 2-core CPU: plain exact decoding 11% faster than with one call per kernel,
    docs/cpu-packing.md).
    Forwards it does not cover (a prefill of sequences longer than `EXACT_MAX_ROWS` tokens, gradients, other
    dtypes) run the layer's own forward.
    """
    attn = self.self_attn
    batch, length, width = hidden_states.shape
    backend = _backend()
    if (
        backend is None
        or length > EXACT_MAX_ROWS
        or hidden_states.dtype != torch.float32
        or hidden_states.device.type != "cpu"
        or position_embeddings is None
        or attn.config._attn_implementation != EXACT_ATTENTION
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
    _check_attention_options(attn, 0.0, kwargs)
    mask = _bool_mask(attention_mask)
    cos, sin = position_embeddings
    return _lean_layer_run(self, backend, hidden_states, _NO_MASK if mask is None else mask, cache, cos, sin, kwargs)


def _lean_layer_run(self, backend, hidden_states, mask, cache, cos, sin, kwargs) -> torch.Tensor:
    """The two compiled calls of a lean layer around its cache update, once [`_lean_layer_forward`] (or
    [`_lean_model_forward`], for all layers at once) has checked that they apply; `mask` is a boolean mask or
    `_NO_MASK` (causal over the cache)."""
    norm_etc, head_counts, post_attention = self.__dict__[_LEAN_ARGS]
    batch, length, width = hidden_states.shape
    x = hidden_states.reshape(batch * length, width)
    # q [B, Hq, L, D], k and v [B, Hkv, L, D]
    q, k, v = backend.attn_in(x, *norm_etc, cos, sin, batch, length, *head_counts)
    if cache is not None:
        k, v = _append_kv(cache, self.self_attn.layer_idx, k, v, kwargs)
    x = backend.attn_out(x, q, k, v, mask, *post_attention)
    return x.view(batch, length, width)


_KV_BUFFERS = "_dspark_kv_buffers"  # on a transformers DynamicLayer: keys and values with room to grow, + views


def _append_kv(cache, index: int, keys: torch.Tensor, values: torch.Tensor, kwargs: dict):
    """`cache.update(keys, values, index)` for a plain `DynamicLayer`, without its concatenation.

    transformers' `DynamicLayer` appends by `torch.cat`, copying the layer's whole cache on every forward
    (30 layers x two copies of the context per decoded token). Here the layer's keys and values become views
    of buffers with room to grow (capacity doubling), and each forward writes only its new positions; the
    values the layer holds, and therefore what attention reads, are the same. A crop shortens the view and the
    next write overwrites the cropped positions. Any other cache or layer type (the engine's slot caches,
    sliding windows, offloading), or a layer whose tensors were replaced since (a prefill on the stock path,
    a beam reorder), goes through the cache's own `update` or starts a fresh buffer.
    """
    batch, heads, new, dim = keys.shape
    room = _kv_room(cache, index, batch, heads, new, dim, keys.dtype) if values.shape == keys.shape else None
    if room is None:
        return cache.update(keys, values, index, kwargs=kwargs)
    layer, keys_buffer, values_buffer, n = room
    keys_buffer.narrow(2, n, new).copy_(keys)
    values_buffer.narrow(2, n, new).copy_(values)
    _hold_kv(layer, keys_buffer, values_buffer, keys_buffer.narrow(2, 0, n + new), values_buffer.narrow(2, 0, n + new))
    return layer.keys, layer.values


def _kv_room(cache, index: int, batch: int, heads: int, new: int, dim: int, dtype: torch.dtype):
    """`(layer, keys buffer, values buffer, n)` for appending `new` positions to layer `index` of `cache` at
    position `n` (its current length) in place ([`_append_kv`]), or `None` when the layer must be updated by
    the cache itself (another cache or layer type, a layer not filled yet, other shapes)."""
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers) or getattr(cache, "offloading", False):
        return None
    layer = layers[index]
    if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys.dim() != 4:
        return None
    held_k, held_v = layer.keys, layer.values
    n = held_k.shape[2]
    buffers = layer.__dict__.get(_KV_BUFFERS)  # (keys buffer, values buffer, keys view, values view) or None
    if buffers is not None and held_k is buffers[2] and held_v is buffers[3]:
        # the very views set last time (a crop or a reorder assigns new tensors): only room and shape to check
        fits = n + new <= buffers[0].shape[2] and buffers[0].shape[0] == batch
    else:
        fits = (
            buffers is not None
            and held_k.data_ptr() == buffers[0].data_ptr()
            and held_v.data_ptr() == buffers[1].data_ptr()
            and held_k.stride() == buffers[0].stride()
            and held_v.stride() == buffers[1].stride()
            and n + new <= buffers[0].shape[2]
            and buffers[0].shape[0] == batch
        )
    fits = fits and buffers[0].shape[1] == heads and buffers[0].shape[3] == dim and buffers[0].dtype == dtype
    if fits:
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


def _hold_kv(layer, keys_buffer, values_buffer, keys, values) -> None:
    """Make `keys`/`values` (views of the buffers' first positions) the layer's cache."""
    layer.keys, layer.values = keys, values
    layer.__dict__[_KV_BUFFERS] = (keys_buffer, values_buffer, keys, values)


def _epsilon(norm: nn.Module) -> float:
    """An RMSNorm's epsilon: transformers' norms call it `variance_epsilon`, the draft's `eps`."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _lean_arguments(layer: nn.Module) -> tuple[tuple, tuple, tuple]:
    """The weights and constants of one layer's two fused calls (a transformers Llama-family layer or a DSpark
    draft's Qwen3-style layer), gathered once when the exact mode starts (a forward then skips ~40 module
    attribute lookups). They are the parameter tensors themselves, so in-place updates of the weights are seen;
    assigning a new parameter object inside the `exact_kernels` block is not."""
    attn, mlp, pre, post = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    qk_norm = hasattr(attn, "q_norm")  # Qwen3 and the draft: RMSNorm over each head's vector before the rotation
    norm_etc = (
        pre.weight,
        _epsilon(pre),
        attn.q_proj.weight,
        attn.q_proj.bias,
        attn.k_proj.weight,
        attn.k_proj.bias,
        attn.v_proj.weight,
        attn.v_proj.bias,
        attn.q_norm.weight if qk_norm else None,
        attn.k_norm.weight if qk_norm else None,
        _epsilon(attn.q_norm) if qk_norm else 0.0,
        _epsilon(attn.k_norm) if qk_norm else 0.0,
    )
    head_counts = (attn.q_proj.weight.shape[0] // attn.head_dim, attn.k_proj.weight.shape[0] // attn.head_dim)
    scale = getattr(attn, "scaling", None)  # transformers' layers; the draft's eligible layers use the usual one
    post_attention = (
        float(attn.head_dim**-0.5 if scale is None else scale),
        attn.o_proj.weight,
        attn.o_proj.bias,
        post.weight,
        _epsilon(post),
        mlp.gate_proj.weight,
        mlp.gate_proj.bias,
        mlp.up_proj.weight,
        mlp.up_proj.bias,
        mlp.down_proj.weight,
        mlp.down_proj.bias,
    )
    return norm_etc, head_counts, post_attention


def _lean_draft_eligible(layer: nn.Module) -> bool:
    """A DSpark draft's Qwen3-style layer that the compiled layer calls can run: SiLU MLP, q/k RMSNorm, no value
    norm, separate value projection, the usual score scale, plain rotary (no scaling), fp32 CPU weights, no hooks."""
    if type(layer).__name__ != "DSparkDecoderLayer" or "forward" in layer.__dict__:
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
        and all(_plain(m) for m in [layer, attn, mlp, *linears])
    )


def _lean_draft_layer_forward(
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
    backend = _backend()
    if (
        backend is None
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
    rows = x.reshape(batch * length, width)
    q, k, v = backend.attn_in(rows, *norm_etc, cos[:, 0], sin[:, 0], batch, length, *head_counts)
    keys = torch.cat([ctx_keys, k], dim=-2)
    values = torch.cat([ctx_values, v], dim=-2)
    if attention_mask is None:  # the block sees all of its context and itself
        attention_mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
    out = backend.attn_out(rows, q, keys, values, attention_mask, *post_attention)
    return out.view(batch, length, width)


# ---------------------------------------------------------------------------------------------- model forward
#: Base models whose forward [`_lean_model_forward`] replaces in the exact mode once all their layers are lean.
LEAN_MODELS = ("LlamaModel", "Qwen2Model", "Qwen3Model")
_LEAN_MODEL_PARAMETERS = ("self", "input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache")


def _active_output_capture():
    """transformers' output collector of the forward running now (`None` outside any output capture), or the
    string `"unknown"` on a release that keeps it elsewhere (then the model-level lean path is not used)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return "unknown"
    return _active_collector.get()


def _lean_model_eligible(model: nn.Module) -> bool:
    """A transformers Llama/Qwen2/Qwen3 base model whose forward is the one [`_lean_model_forward`] reproduces
    (its parameters, its output's `cache` field, full attention in every layer) and all of whose layers are lean."""
    if type(model).__name__ not in LEAN_MODELS or "forward" in model.__dict__:
        return False
    from transformers.modeling_outputs import BaseModelOutputWithPast

    try:
        parameters = tuple(inspect.signature(inspect.unwrap(type(model).forward)).parameters)
    except (TypeError, ValueError):
        return False
    layers = getattr(model, "layers", None)
    config = model.config
    return (
        parameters[: len(_LEAN_MODEL_PARAMETERS)] == _LEAN_MODEL_PARAMETERS
        and "cache" in BaseModelOutputWithPast.__dataclass_fields__
        and _active_output_capture() != "unknown"
        and isinstance(layers, nn.ModuleList)
        and len(layers) >= config.num_hidden_layers > 0
        and all(is_lean(layer) for layer in layers[: config.num_hidden_layers])
        and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"]))
        and isinstance(getattr(model, "embed_tokens", None), nn.Embedding)
    )


def _lean_model_forward(
    self: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
):
    """A Llama/Qwen2/Qwen3 base model's forward in the exact mode: transformers' own steps (embedding, cache,
    positions, causal mask, rotary embedding, the decoder layers, final norm), with the layers run as one
    compiled call ([`_run_stack`]) once the cache has buffers to write into, else each lean layer's two calls
    made directly; either way without the layers' module calls and argument checks and without transformers'
    output-capturing, config-defaults and keyword-deprecation wrappers. The same kernel calls as the layers'
    own lean forwards, so the output is bit-identical; what goes is ~2 ms of Python per one-token forward of
    SmolLM2-135M (docs/cpu-packing.md). A layer with a hook the stack cannot serve is called as a module (the
    stack then steps aside for the whole forward), so every hook runs as before.

    Any call it does not cover runs the model's own forward: hidden states or attentions asked for (here or in
    the config), `return_dict=False`, other keyword arguments, `inputs_embeds`, sequences longer than
    `EXACT_MAX_ROWS`, gradients, other dtypes or devices.
    """
    config = self.config
    backend = _backend()
    if (
        kwargs.keys() - {"output_hidden_states", "output_attentions", "return_dict"}
        or kwargs.get("output_hidden_states")
        or kwargs.get("output_attentions")
        or kwargs.get("return_dict", True) is False
        or input_ids is None
        or inputs_embeds is not None
        or input_ids.dim() != 2
        or input_ids.shape[1] > EXACT_MAX_ROWS
        or input_ids.device.type != "cpu"
        or backend is None
        or torch.is_grad_enabled()
        or self.embed_tokens.weight.dtype != torch.float32
        or getattr(config, "output_hidden_states", False)
        or getattr(config, "output_attentions", False)
        or getattr(config, "return_dict", True) is False
        or getattr(config, "is_causal", None) is not None
        or config._attn_implementation != EXACT_ATTENTION
        or (isinstance(attention_mask, dict) and type(self).__name__ == "LlamaModel")
        or _active_output_capture() is not None
    ):
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
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast

    if use_cache is None:
        use_cache = getattr(config, "use_cache", None)
    hidden_states = self.embed_tokens(input_ids)
    if use_cache and cache is None:
        cache = DynamicCache(config=config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)
    if isinstance(attention_mask, dict):  # prepared by the caller (Qwen2/Qwen3; every layer is full attention)
        causal_mask = attention_mask["full_attention"]
    else:
        causal_mask = create_causal_mask(
            config=config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    cos, sin = position_embeddings
    mask = _bool_mask(causal_mask)
    mask = _NO_MASK if mask is None else mask
    direct = not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)
    stack = self.__dict__.get(_LEAN_STACK) if direct else None
    out = None if stack is None else _run_stack(stack, backend, hidden_states, mask, cache, cos, sin)
    for layer in itertools.islice(self.layers, config.num_hidden_layers) if out is None else ():
        if (
            direct
            and not layer._forward_hooks
            and not layer._forward_pre_hooks
            and _replaced_forward(layer) is _lean_layer_forward
        ):
            hidden_states = _lean_layer_run(layer, backend, hidden_states, mask, cache, cos, sin, kwargs)
        else:
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
            )
    hidden_states = self.norm(hidden_states if out is None else out)
    return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


_LEAN_STACK = "_dspark_lean_stack"  # on a base model in the exact mode: (handle, [(layer, cache index, Hkv, D)])


def _register_stack(backend, model: nn.Module) -> None:
    """Register a lean base model's layers with the compiled layer stack ([`_run_stack`])."""
    handle, entries = 0, []
    for layer in itertools.islice(model.layers, model.config.num_hidden_layers):
        norm_etc, head_counts, post_attention = layer.__dict__[_LEAN_ARGS]
        handle = backend.stack_add_layer(handle, *norm_etc, *head_counts, *post_attention)
        entries.append((layer, layer.self_attn.layer_idx, head_counts[1], layer.self_attn.head_dim))
    model.__dict__[_LEAN_STACK] = (handle, entries)


def _release_stack(model: nn.Module) -> None:
    stack = model.__dict__.pop(_LEAN_STACK, None)
    backend = _backend()
    if stack is not None and backend is not None:
        backend.stack_free(stack[0])


def _run_stack(stack, backend, hidden_states, mask, cache, cos, sin) -> torch.Tensor | None:
    """All lean layers of a base model in one compiled call (`stack_run`: each layer's `attn_in`, its keys and
    values written into the cache's buffers, `attn_out`), the same calls as [`_lean_layer_run`] layer by layer,
    so the output and the cache are bit-identical. Forward hooks that only read a layer's output (DSpark's
    feature recording, marked [`OUTPUT_ONLY_HOOK`]) get that output; transformers' output-capturing hooks are
    inactive here (nothing is being captured). Returns `None` (run layer by layer instead) for any other hook,
    a layer not on its lean forward, or a cache that cannot take the new positions in place."""
    handle, entries = stack
    record, hooks = [], []
    for i, (layer, _, _, _) in enumerate(entries):
        if layer._forward_pre_hooks or _replaced_forward(layer) is not _lean_layer_forward:
            return None
        for hook in layer._forward_hooks.values():
            if getattr(hook, OUTPUT_ONLY_HOOK, False):
                record.append(i)
                hooks.append((hook, layer))
            elif not _output_capturing(hook):
                return None
    batch, length, width = hidden_states.shape
    rooms, past = [], 0
    if cache is not None:
        for _, index, heads, dim in entries:
            room = _kv_room(cache, index, batch, heads, length, dim, hidden_states.dtype)
            if room is None or (rooms and room[3] != past):
                return None
            rooms.append(room)
            past = room[3]
    out = backend.stack_run(
        handle,
        hidden_states.reshape(batch * length, width),
        cos,
        sin,
        mask,
        batch,
        length,
        [room[1] for room in rooms],
        [room[2] for room in rooms],
        past,
        record,
    )
    n = len(rooms)
    for i, (layer, keys_buffer, values_buffer, _) in enumerate(rooms):
        _hold_kv(layer, keys_buffer, values_buffer, out[1 + i], out[1 + n + i])
    for (hook, layer), output in zip(hooks, out[1 + 2 * n :]):
        hook(layer, (), output)
    return out[0]


def is_exact_norm(module: nn.Module) -> bool:
    """Whether a DSpark draft's RMSNorm currently runs on the compiled `rms_norm` ([`exact_kernels`])."""
    return _replaced_forward(module) is _exact_norm_forward


def is_lean_model(model: nn.Module) -> bool:
    """Whether a base model (e.g. `LlamaModel`) currently runs the exact mode's [`_lean_model_forward`]."""
    return _replaced_forward(model) is _lean_model_forward


def is_lean(layer: nn.Module) -> bool:
    """Whether a decoder layer currently runs the exact mode's lean path ([`_lean_layer_forward`], or for a DSpark
    draft's layer [`_lean_draft_layer_forward`])."""
    return _replaced_forward(layer) in (_lean_layer_forward, _lean_draft_layer_forward)


# ---------------------------------------------------------------------------------------------- modes
@contextlib.contextmanager
def exact_kernels(*models: nn.Module | None) -> Iterator[None]:
    """Run `models` on the exact kernels inside the block, then restore them.

    Every eligible `nn.Linear` (plain CPU linears; not subclasses or already-hooked ones) runs on
    [`exact_linear`]; every transformers model whose attention goes through `AttentionInterface` runs it
    through [`exact_attention_forward`] (a DSpark draft keeps its own attention: only the target's forward
    needs to be batch-invariant). Models already in the exact mode are left as they are.
    """
    _backend()  # build (or load) the kernels now, not inside the first forward
    _register_attention()
    changed: list[nn.Module] = []
    flagged: list[nn.Module] = []
    attn: list[tuple[nn.Module, str]] = []
    try:
        for model in models:
            if model is None:
                continue
            config = getattr(model, "config", None)
            current = getattr(config, "_attn_implementation", None)
            # only models whose attention goes through transformers' AttentionInterface (a DSpark draft calls
            # its own attention and keeps it)
            if (
                current is not None
                and current != EXACT_ATTENTION
                and getattr(model, "_supports_attention_backend", False)
                and hasattr(model, "set_attn_implementation")
            ):
                model.set_attn_implementation(EXACT_ATTENTION)
                attn.append((model, current))
            lean = (
                [m for m in model.modules() if _lean_eligible(m)]
                if _backend() is not None and getattr(config, "_attn_implementation", None) == EXACT_ATTENTION
                else []
            )
            for module in model.modules():
                if not module.__dict__.get(_EXACT_FLAG, False):
                    module.__dict__[_EXACT_FLAG] = True  # read by mode_linear
                    flagged.append(module)
                if _eligible(module):
                    module.forward = types.MethodType(_exact_forward, module)
                    changed.append(module)
            for layer in lean:
                layer.__dict__[_LEAN_ARGS] = _lean_arguments(layer)
                layer.forward = types.MethodType(_lean_layer_forward, layer)
                changed.append(layer)
            # then the base model itself (all of its layers lean): the layers' calls made directly
            for base in [m for m in model.modules() if _lean_model_eligible(m)] if lean else []:
                base.forward = types.MethodType(_lean_model_forward, base)
                changed.append(base)
                _register_stack(_backend(), base)
            if _backend() is not None:  # a DSpark draft's own layers and norms: the same compiled calls
                for layer in [m for m in model.modules() if _lean_draft_eligible(m)]:
                    layer.__dict__[_LEAN_ARGS] = _lean_arguments(layer)
                    layer.forward = types.MethodType(_lean_draft_layer_forward, layer)
                    changed.append(layer)
                for norm in [m for m in model.modules() if _draft_norm_eligible(m)]:
                    norm.forward = types.MethodType(_exact_norm_forward, norm)
                    changed.append(norm)
        yield
    finally:
        for module in changed:
            if is_lean_model(module):
                _release_stack(module)
            if is_exact(module) or is_lean(module) or is_lean_model(module) or is_exact_norm(module):
                del module.forward
            module.__dict__.pop(_LEAN_ARGS, None)
        for module in flagged:
            module.__dict__.pop(_EXACT_FLAG, None)
        for model, previous in reversed(attn):
            model.set_attn_implementation(previous)


@contextlib.contextmanager
def use_kernels(*models: nn.Module | None, mode: str) -> Iterator[str]:
    """Run `models` (a target and optionally its draft) on the kernels of `mode` inside the block.

    Args:
        *models (`nn.Module`): the models to switch (`None` entries are skipped).
        mode (`str`): `"stock"` (leave them as they are), `"packed"` (oneDNN packed linear weights, see
            [`packed_linears`]) or `"exact"` (batch-invariant kernels, see [`exact_kernels`]).

    Yields the mode. On a model whose weights are not on the CPU the exact and packed modes change nothing
    (their kernels are CPU kernels).
    """
    _check_mode(mode)
    if mode == "stock":
        yield mode
    elif mode == "packed":
        with packed_linears(*models, enabled=packing_available()):
            yield mode
    else:
        with exact_kernels(*models):
            yield mode
