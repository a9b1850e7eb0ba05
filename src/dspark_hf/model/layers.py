"""The draft's decoder layers: norms, rotary embedding, context-injecting attention, gated MLP.

Two layer styles, chosen by `DSparkConfig.layer_style`, each matching one of DeepSpec's draft models weight
for weight (so import and export are renames-free copies):

* `"qwen3"` (DeepSpec's `Qwen3DSparkModel`, and the speculators library's DSpark/DFlash drafts): pre-norm
  attention and MLP, RMSNorm on queries and keys, attention scale `1/sqrt(head_dim)`.
* `"gemma4"` (DeepSpec's `Gemma4DSparkModel`): Gemma's sandwich norms (a norm before *and* after attention
  and MLP), an unscaled RMSNorm on the values, attention scale 1, optionally values equal to the key
  projection (`attention_k_eq_v`), and a learned scalar on each layer's output.

Either style's layer can be a full-attention layer (the block sees all of its context and itself,
bidirectionally) or a sliding-window layer (`DSparkConfig.layer_types`): the block then sees only the
`sliding_window` context tokens before its anchor and, unless `sliding_window_non_causal`, its own slots up to
the query's, as speculators trains such layers.

The rotary embedding is computed by transformers' own functions (`ROPE_INIT_FUNCTIONS` for YaRN, llama3,
linear and proportional rotary), so a draft rotates exactly like its target family; the activation comes from
`transformers.activations.ACT2FN`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .configuration import SLIDING_ATTENTION, DSparkConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as in Llama/Qwen), scaled by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma4's RMSNorm: the weight is applied in fp32 before the cast back; `with_scale=False` has no weight."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.pow(out.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def rotary_frequencies(config: DSparkConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim / 2]` (fp32) and the cos/sin scale of the draft's rotary embedding.

    `default` keeps the plain formula `1 / θ^(2i/d)`; every other supported type is computed by transformers'
    own `ROPE_INIT_FUNCTIONS` from `config.rope_parameters` (which `DSparkConfig` validates).
    """
    rope = config.rope_parameters
    if rope["rope_type"] == "default":
        hd = config.head_dim
        theta = float(rope["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, device)
    if inv_freq.numel() * 2 != config.head_dim:
        raise ValueError(
            f"rope_parameters {rope} give {inv_freq.numel()} rotary frequencies for head_dim={config.head_dim}; "
            "DSpark draft layers rotate the whole head. Use a full rotary (partial_rotary_factor=1)."
        )
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """cos/sin tables of the draft's rotary embedding at given positions (rotate-half convention).

    Not an `nn.Module`: the frequencies must stay fp32 when the draft is cast to bf16 (a buffer would be
    cast), so they are kept per device in a plain dict.
    """

    def __init__(self, config: DSparkConfig) -> None:
        self.config = config
        self._freqs: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` `[B, T]` → `cos`, `sin` `[B, 1, T, head_dim]` in `dtype`."""
        device = positions.device
        if device not in self._freqs:
            self._freqs[device] = rotary_frequencies(self.config, device)
        inv_freq, scaling = self._freqs[device]
        angles = positions.to(torch.float32)[:, None, :, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[B, H, T, hd]` at `positions` `[B, T]`."""
        cos, sin = self.cos_sin(positions, x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class DSparkAttention(nn.Module):
    """Attention whose queries come from the block and whose keys/values cover `[context ; block]`.

    Layer `layer_idx` of a draft whose `config.layer_types` makes it `"sliding_attention"` has `sliding_window`
    set: see [`sliding_mask`].
    """

    def __init__(self, config: DSparkConfig, rotary: RotaryEmbedding, layer_idx: int = 0) -> None:
        super().__init__()
        sliding = config.layer_type(layer_idx) == SLIDING_ATTENTION
        self.sliding_window = config.sliding_window if sliding else None
        self.causal_block = sliding and not config.sliding_window_non_causal
        self.block_slots = config.backbone_slots
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary = rotary
        gemma = config.layer_style == "gemma4"
        self.k_eq_v = config.attention_k_eq_v
        # Gemma4 normalises q/k (and v) without the 1/sqrt(d) score scale; Qwen3 uses the usual one (SDPA's default).
        self.scale = 1.0 if gemma else None
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = None if self.k_eq_v else nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        norm = GemmaRMSNorm if gemma else RMSNorm
        self.q_norm = norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False) if gemma else None

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of context features `[B, T, d]` at absolute `positions`."""
        raw_keys = self._split(self.k_proj(context), self.num_kv_heads)
        values = raw_keys if self.k_eq_v else self._split(self.v_proj(context), self.num_kv_heads)
        if self.v_norm is not None:
            values = self.v_norm(values)
        return self.rotary.apply(self.k_norm(raw_keys), positions), values

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_keys: torch.Tensor,
        ctx_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        queries = self.rotary.apply(self.q_norm(self._split(self.q_proj(x), self.num_heads)), positions)
        blk_keys, blk_values = self.context_kv(x, positions)
        keys = torch.cat([ctx_keys, blk_keys], dim=-2)
        values = torch.cat([ctx_values, blk_values], dim=-2)
        if self.num_kv_heads != self.num_heads:
            repeat = self.num_heads // self.num_kv_heads
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
        if self.sliding_window is not None:
            attention_mask = self.sliding_mask(positions, ctx_keys.shape[-2], attention_mask)
        # Full attention: no causal mask, the block is bidirectional and sees all (position-filtered) context.
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attention_mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def sliding_mask(
        self, positions: torch.Tensor, context_length: int, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The sliding layer's mask `[B, 1, S, T + S]` (`True` = may attend), within `attention_mask` if given.

        The `S` block slots are blocks of `block_slots` (several packed in training); context key `j` is the token
        at position `j` (the draft's context holds every committed token from position 0 on). A query of the block
        anchored at `a` (the position of its block's first slot) sees context positions `a - W … a - 1` and the
        slots of its own block, only those up to its own unless the window is non-causal: the mask speculators
        trains sliding layers with (`create_anchor_block_mask_mod`), whose window is counted from the anchor.
        """
        bsz, length = positions.shape
        slots = self.block_slots
        device = positions.device
        anchor = positions.reshape(bsz, length // slots, slots)[..., :1].expand(-1, -1, slots).reshape(bsz, length)
        ctx = torch.arange(context_length, device=device)
        see_ctx = (ctx[None, None, :] >= (anchor - self.sliding_window)[:, :, None]) & (
            ctx[None, None, :] < anchor[:, :, None]
        )
        slot = torch.arange(length, device=device)
        see_blk = slot[:, None] // slots == slot[None, :] // slots
        if self.causal_block:
            see_blk = see_blk & (slot[None, :] <= slot[:, None])
        mask = torch.cat([see_ctx, see_blk[None].expand(bsz, -1, -1)], dim=-1)[:, None]
        if attention_mask is not None:  # boolean (this package's masks), or additive with -inf / min where masked
            if attention_mask.dtype != torch.bool:
                attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min
            mask = mask & attention_mask
        return mask


class DSparkMLP(nn.Module):
    """Gated feed-forward block `down(act(gate(x)) * up(x))`; `act` is `config.hidden_act` (SiLU: SwiGLU)."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm decoder layer (Qwen3 style: RMSNorm on queries and keys) with context KV injection."""

    def __init__(self, config: DSparkConfig, rotary: RotaryEmbedding, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config, rotary, layer_idx)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, ctx_keys, ctx_values, attention_mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_keys, ctx_values, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma4DecoderLayer(nn.Module):
    """DeepSpec's Gemma4 draft layer: norms before and after attention and MLP, then a learned output scalar.

    Weight names are Gemma4's: `post_attention_layernorm` normalises the attention *output* here (in the
    Qwen3 layer it is the norm before the MLP), `pre_feedforward_layernorm` / `post_feedforward_layernorm`
    wrap the MLP, and `layer_scalar` is a saved buffer.
    """

    def __init__(self, config: DSparkConfig, rotary: RotaryEmbedding, layer_idx: int = 0) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DSparkAttention(config, rotary, layer_idx)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, positions, ctx_keys, ctx_values, attention_mask=None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, ctx_keys, ctx_values, attention_mask)
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


DECODER_LAYERS = {"qwen3": DSparkDecoderLayer, "gemma4": Gemma4DecoderLayer}


def build_layers(config: DSparkConfig) -> nn.ModuleList:
    """The draft's `config.num_hidden_layers` decoder layers, sharing one rotary embedding."""
    rotary = RotaryEmbedding(config)
    layer_cls = DECODER_LAYERS[config.layer_style]
    return nn.ModuleList(layer_cls(config, rotary, i) for i in range(config.num_hidden_layers))


def final_norm(config: DSparkConfig) -> nn.Module:
    """The norm of the context features (`hidden_norm`) and of the last layer (`norm`), in the layer style."""
    return (GemmaRMSNorm if config.layer_style == "gemma4" else RMSNorm)(config.hidden_size, config.rms_norm_eps)
