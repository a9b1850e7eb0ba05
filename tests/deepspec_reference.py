"""An independent restatement of DeepSpec's draft models, for checking import and export against them.

(speculators' DSpark draft is the same model as DeepSpec's Qwen3 draft; `reference_forward` reads its folder too:
the logits then cover the checkpoint's draft vocabulary, the rows of its `lm_head`.)

Two parts, both written from DeepSpec's code (`deepspec/modeling/dspark/{qwen3,gemma4}/`), not from
`dspark_hf.model.modeling`:

* `write_deepspec_checkpoint`: a checkpoint in DeepSpec's layout, the way DeepSpec's `build_draft_config`
  makes it (a deep copy of the target's text config plus the DSpark fields, `architectures`
  `Qwen3DSparkModel` / `Gemma4DSparkModel`) and the weight names and shapes its modules create, random values.
* `reference_forward`: DeepSpec's forward for one block from such a folder: transformers parses the config
  (so rotary and activation resolve as in DeepSpec), transformers' rotary classes and `ACT2FN` compute, and the
  draft math (fc + hidden norm, context K/V injection, attention, norms, MLP, Markov bias, confidence head) is
  spelled out here in plain torch.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.activations import ACT2FN


def _rms(x, weight, eps, gemma: bool):
    """Qwen3RMSNorm (weight applied after the cast back) or Gemma4RMSNorm (in fp32, optional weight)."""
    xf = x.float()
    if gemma:
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return (out if weight is None else out * weight.float()).type_as(x)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * out.to(x.dtype)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def write_deepspec_checkpoint(
    folder,
    target,
    *,
    num_layers: int = 2,
    block_size: int = 4,
    target_layer_ids=(1, 3),
    markov_rank: int = 16,
    markov_head_type: str = "vanilla",
    confidence: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Write a DeepSpec-layout draft for `target` (a Qwen3/Llama-family or Gemma4 causal LM); returns the config."""
    text = target.config.get_text_config()
    gemma = str(text.model_type).startswith("gemma4")
    cfg = text.to_dict()
    for key in ("_name_or_path", "transformers_version", "auto_map"):
        cfg.pop(key, None)
    d, heads = text.hidden_size, text.num_attention_heads
    if gemma:  # DeepSpec pins transformers 5.10, whose Gemma4 config names the full-attention shape like this
        full = text.per_layer_config["full_attention"]
        cfg.pop("per_layer_config", None)
        cfg["global_head_dim"] = full.head_dim
        cfg["num_global_key_value_heads"] = full.num_key_value_heads
        hd = full.head_dim
        kv = full.num_key_value_heads if text.attention_k_eq_v else text.num_key_value_heads
        cfg.update(
            architectures=["Gemma4DSparkModel"],
            target_model_type=target.config.model_type,
            target_text_model_type=text.model_type,
        )
    else:
        hd = getattr(text, "head_dim", None) or d // heads
        kv = text.num_key_value_heads
        cfg.update(architectures=["Qwen3DSparkModel"])
        if cfg.get("model_type") != "qwen3":  # DeepSpec's Qwen3 drafts: the target's fields, read as a Qwen3Config
            cfg["model_type"] = "qwen3"
    cfg.update(
        num_target_layers=text.num_hidden_layers,
        num_hidden_layers=num_layers,
        block_size=block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers,
        mask_token_id=text.vocab_size - 1,
        target_layer_ids=list(target_layer_ids),
        num_anchors=512,
        enable_confidence_head=confidence,
        markov_rank=markov_rank,
    )
    if confidence:
        cfg["confidence_head_with_markov"] = markov_rank > 0
    if markov_rank:
        cfg["markov_head_type"] = markov_head_type
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + rnd(n)

    w = {"fc.weight": rnd(d, len(target_layer_ids) * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    inter = text.intermediate_size
    for i in range(num_layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = rnd(kv * hd, d)
        if not (gemma and text.attention_k_eq_v):
            w[p + "self_attn.v_proj.weight"] = rnd(kv * hd, d)
        w[p + "self_attn.o_proj.weight"] = rnd(d, heads * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, d)
        w[p + "mlp.up_proj.weight"] = rnd(inter, d)
        w[p + "mlp.down_proj.weight"] = rnd(d, inter)
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(d)
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
            w[p + "layer_scalar"] = torch.tensor([0.8 + 0.1 * i])
    if markov_rank:
        w["markov_head.markov_w1.weight"] = rnd(text.vocab_size, markov_rank, scale=1.0)
        w["markov_head.markov_w2.weight"] = rnd(text.vocab_size, markov_rank)
        if markov_head_type == "gated":
            w["markov_head.gate_proj.weight"] = rnd(markov_rank, d + markov_rank)
            w["markov_head.gate_proj.bias"] = rnd(markov_rank)
    if confidence:
        w["confidence_head.proj.weight"] = rnd(1, d + markov_rank)
        w["confidence_head.proj.bias"] = rnd(1)
    w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    w["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


@torch.no_grad()
def reference_forward(folder, features, block_ids, prev_ids, rope_override: dict | None = None, act: str | None = None):
    """DeepSpec's draft on one block read from `folder`: `(logits, base_logits, confidence_logits)`, fp32.

    Args:
        features: `[1, T, m·d]` raw target-layer features of the context (positions `0..T-1`).
        block_ids: `[1, γ]` the block `[anchor, mask, …]` at positions `T..T+γ-1`.
        prev_ids: `[1, γ]` the token before each predicted one (anchor first).
        rope_override, act: replace the config's rotary / activation (negative controls only).
    """
    raw = json.load(open(os.path.join(folder, "config.json")))
    if "speculators_model_type" in raw:  # speculators: the layers' config is nested, the heads' fields top-level
        layer = raw["transformer_layer_config"]
        raw = {**layer, **{k: v for k, v in raw.items() if k != "transformer_layer_config"}}
        raw["num_hidden_layers"] = layer["num_hidden_layers"]
        raw["model_type"] = layer.get("model_type", "qwen3")
    gemma = raw["architectures"] == ["Gemma4DSparkModel"]
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
    cfg = AutoConfig.for_model(raw["model_type"], **fields)
    w = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    eps, d = cfg.rms_norm_eps, cfg.hidden_size
    heads = cfg.num_attention_heads
    if gemma:
        hd = raw["global_head_dim"]
        kv = raw["num_global_key_value_heads"] if raw.get("attention_k_eq_v") else raw["num_key_value_heads"]
        scaling, k_eq_v = 1.0, bool(raw.get("attention_k_eq_v"))
        act_fn = ACT2FN[act or raw["hidden_activation"]]
    else:
        hd = raw.get("head_dim") or d // heads
        kv = raw["num_key_value_heads"]
        scaling, k_eq_v = hd**-0.5, False
        act_fn = ACT2FN[act or cfg.hidden_act]
    if rope_override is not None:
        cfg.rope_parameters = {**cfg.rope_parameters, "full_attention": rope_override} if gemma else dict(rope_override)
    features, block_ids, prev_ids = features.float(), block_ids, prev_ids
    T, S = features.shape[1], block_ids.shape[1]
    positions = torch.arange(T + S)[None]
    x = torch.nn.functional.embedding(block_ids, w["embed_tokens.weight"])
    if gemma:
        x = x * torch.tensor(float(d) ** 0.5)
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        cos, sin = Gemma4TextRotaryEmbedding(cfg)(x, positions, "full_attention")
    else:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        cos, sin = Qwen3RotaryEmbedding(cfg)(x, positions)
    cos, sin = cos[:, None], sin[:, None]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps, gemma)
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps, gemma)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(1, S, heads, hd)
        q = _rms(q, w[p + "self_attn.q_norm.weight"], eps, gemma).transpose(1, 2)
        both = torch.cat([ctx, h], dim=1)
        k = (both @ w[p + "self_attn.k_proj.weight"].T).view(1, T + S, kv, hd)
        v = k if k_eq_v else (both @ w[p + "self_attn.v_proj.weight"].T).view(1, T + S, kv, hd)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps, gemma).transpose(1, 2)
        v = (_rms(v, None, eps, True) if gemma else v).transpose(1, 2)
        q = q * cos[..., -S:, :] + _rotate_half(q) * sin[..., -S:, :]
        k = k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        attn = torch.softmax((q @ k.transpose(-1, -2)) * scaling, dim=-1) @ v  # block sees all context, itself
        o = attn.transpose(1, 2).reshape(1, S, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            x = x + _rms(o, w[p + "post_attention_layernorm.weight"], eps, True)
            h = _rms(x, w[p + "pre_feedforward_layernorm.weight"], eps, True)
        else:
            x = x + o
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps, False)
        m = (act_fn(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        if gemma:
            x = (x + _rms(m, w[p + "post_feedforward_layernorm.weight"], eps, True)) * w[p + "layer_scalar"]
        else:
            x = x + m
    out = _rms(x, w["norm.weight"], eps, gemma)
    base = out @ w["lm_head.weight"].T
    cap = raw.get("final_logit_softcapping") if gemma else None
    if cap:
        base = torch.tanh(base / cap) * cap
    logits, prev_emb = base, None
    if raw.get("markov_rank"):
        prev_emb = torch.nn.functional.embedding(prev_ids, w["markov_head.markov_w1.weight"])
        feature = prev_emb
        if raw.get("markov_head_type") == "gated":
            gate = torch.cat([out, prev_emb], dim=-1) @ w["markov_head.gate_proj.weight"].T
            feature = torch.sigmoid(gate + w["markov_head.gate_proj.bias"]) * prev_emb
        logits = base + feature @ w["markov_head.markov_w2.weight"].T
    conf = None
    if raw.get("enable_confidence_head"):
        feats = torch.cat([out, prev_emb], dim=-1) if raw.get("confidence_head_with_markov") else out
        conf = (feats @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]).squeeze(-1)
    return logits, base, conf


def block_inputs(draft_or_config, context_len: int = 9, seed: int = 0):
    """Random context features, a block `[anchor, mask…]` and previous tokens for a draft/config."""
    c = getattr(draft_or_config, "config", draft_or_config)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, context_len, len(c.target_layer_ids) * c.hidden_size, generator=g)
    gamma = c.block_size
    tokens = torch.randint(0, c.vocab_size - 1, (1, gamma), generator=g)
    block = torch.full((1, gamma), c.mask_token_id)
    block[0, 0] = tokens[0, 0]
    return feats, block, tokens  # prev ids: the anchor, then the (teacher-forced) drafted tokens


def ours(draft, feats, block, prev):
    """Our draft's forward on the same block, fp32."""
    gamma = block.shape[1]
    positions = torch.arange(feats.shape[1], feats.shape[1] + gamma)[None]
    with torch.no_grad():
        out = draft(feats.to(draft.dtype), block, positions, prev)
    conf = None if out.confidence_logits is None else out.confidence_logits.float()
    return out.logits.float(), out.base_logits.float(), conf


def max_diff(a, b) -> float:
    return float((a - b).abs().max()) if a is not None else (0.0 if b is None else math.inf)
