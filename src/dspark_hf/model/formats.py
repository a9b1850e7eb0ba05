"""Import and export of DeepSpec's checkpoint format (DeepSeek's released DSpark/DFlash drafts).

DeepSpec drafts (e.g. `deepseek-ai/dspark_qwen3_4b_block7`, `dspark_gemma4_12b_block7`) are a `config.json`
(a copy of the target's text config plus DSpark fields) and `model.safetensors` whose keys have no `model.`
prefix. `architectures` names the draft model: `Qwen3DSparkModel` (layer style `"qwen3"`) or
`Gemma4DSparkModel` (layer style `"gemma4"`); anything else is refused. This is also the format vLLM
(`method: "dspark"`), SGLang (`DSPARK`) and TensorRT-LLM serve.

The target-derived fields are read the way DeepSpec's own model code reads them: the config is parsed by
transformers' config class for its `model_type` (so `rope_parameters` / `rope_scaling` / `rope_theta` resolve
exactly as in DeepSpec), the rotary parameters and activation are honoured, and fields dspark-hf cannot
reproduce (sliding-window draft layers, Gemma4 MoE or per-layer inputs, length-dependent rotaries) are
refused with an error. `docs/deepspec-format.md` lists every field.

Weights keep their names (`fc`, `hidden_norm`, `norm`, `layers.*`, `markov_head.*`, `confidence_head.*`);
`embed_tokens.weight` and `lm_head.weight` are frozen copies of the target's: on import they are
fingerprinted (`DSparkConfig.target_weights_fingerprint`, checked when a target is bound) and dropped, and on
export they are written from the bound target.

A draft vocabulary subset (`set_draft_vocab`, `docs/draft-vocab.md`) has no place in DeepSpec's format, whose
servers draft over the full vocabulary: export writes the full-vocabulary draft and drops the subset with a
warning (save with `save_pretrained` to keep it); import gives a full-vocabulary draft.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .configuration import DSparkConfig, rope_parameters_of
from .fingerprint import fingerprint_copies

DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
DEEPSPEC_ARCHITECTURES = {"Qwen3DSparkModel": "qwen3", "Gemma4DSparkModel": "gemma4"}
_ARCHITECTURE_OF_STYLE = {v: k for k, v in DEEPSPEC_ARCHITECTURES.items()}
_HEAD_FROM_DEEPSPEC = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
_HEAD_TO_DEEPSPEC = {v: k for k, v in _HEAD_FROM_DEEPSPEC.items()}
_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")


def _resolve(path_or_repo: str, filename: str, revision: str | None = None, token: Any = None) -> str | None:
    """Local file path of `filename` in a folder or Hub repo; `None` if it does not exist."""
    if os.path.isdir(path_or_repo):
        full = os.path.join(path_or_repo, filename)
        return full if os.path.exists(full) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(path_or_repo, filename, revision=revision, token=token)
    except EntryNotFoundError:
        return None


def _read_config(path_or_repo: str, revision: str | None = None, token: Any = None) -> dict | None:
    try:
        path = _resolve(path_or_repo, "config.json", revision, token)
    except Exception:  # not a folder and not reachable as a repo: let transformers report it
        return None
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_deepspec_config(cfg: dict) -> bool:
    """Whether a parsed `config.json` is in DeepSpec's format (not our own `model_type="dspark"`)."""
    return (
        cfg.get("model_type") != "dspark"
        and "speculators_model_type" not in cfg
        and "block_size" in cfg
        and "target_layer_ids" in cfg
    )


def is_deepspec_checkpoint(path_or_repo: str, revision: str | None = None, token: Any = None) -> bool:
    """Whether `path_or_repo` (folder or Hub id) holds a DeepSpec-format draft."""
    cfg = _read_config(os.fspath(path_or_repo), revision, token)
    return cfg is not None and is_deepspec_config(cfg)


def _text_config(cfg: dict) -> Any:
    """`cfg` parsed by transformers' config class for its `model_type`, as DeepSpec's model code sees it."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "transformers_version")}
    try:
        return AutoConfig.for_model(cfg.get("model_type"), **fields)
    except (KeyError, ValueError) as err:
        raise ValueError(
            f"DeepSpec config has model_type={cfg.get('model_type')!r}, which this transformers version cannot "
            f"parse ({err}); DeepSpec drafts use 'qwen3' or 'gemma4_text'."
        ) from None


def _refuse_unsupported(cfg: dict, style: str) -> None:
    """Raise for DeepSpec config fields whose computation the draft layers do not reproduce."""
    layer_types = cfg.get("layer_types") or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"DeepSpec config has layer_types={layer_types}: dspark-hf draft layers are full-attention only, so a "
            "draft with sliding-window layers cannot be loaded exactly."
        )
    if style == "gemma4":
        if cfg.get("enable_moe_block"):
            raise ValueError("DeepSpec Gemma4 config sets enable_moe_block=true; MoE draft layers are not supported.")
        if int(cfg.get("hidden_size_per_layer_input") or 0):
            raise ValueError(
                f"DeepSpec Gemma4 config sets hidden_size_per_layer_input={cfg['hidden_size_per_layer_input']}; "
                "per-layer input gates are not supported (DeepSpec's Gemma4 draft refuses them too)."
            )
    markov = int(cfg.get("markov_rank", 0) or 0)
    head_type = cfg.get("markov_head_type", "vanilla")
    if markov and head_type not in _HEAD_FROM_DEEPSPEC:
        raise ValueError(f"Unknown DeepSpec markov_head_type {head_type!r}; supported: {sorted(_HEAD_FROM_DEEPSPEC)}.")
    if cfg.get("enable_confidence_head") and cfg.get("confidence_head_with_markov") and not markov:
        raise ValueError("DeepSpec config sets confidence_head_with_markov=true with markov_rank=0 (no Markov head).")


def _gemma4_shape(cfg: dict, text: Any) -> dict[str, Any]:
    """Head width and KV heads of a Gemma4 draft's (full-attention) layers, from either config generation."""
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    per_layer = getattr(text, "per_layer_config", None)
    full = None
    if per_layer is not None:
        try:
            full = per_layer["full_attention"]
        except (KeyError, TypeError, ValueError):
            full = None
    head_dim = cfg.get("global_head_dim") or getattr(full, "head_dim", None) or cfg.get("head_dim")
    kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
    kv = kv or (getattr(full, "num_key_value_heads", None) if k_eq_v else None) or cfg["num_key_value_heads"]
    return {
        "layer_style": "gemma4",
        "attention_k_eq_v": k_eq_v,
        "head_dim": int(head_dim),
        "num_key_value_heads": int(kv),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }


def config_from_deepspec(cfg: dict) -> DSparkConfig:
    """Translate a DeepSpec `config.json` dict into a [`DSparkConfig`].

    Raises:
        `ValueError`: for an unknown `architectures` entry or a setting the draft layers cannot reproduce.
    """
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    style = DEEPSPEC_ARCHITECTURES.get(arch)
    if style is None:
        raise ValueError(
            f"DeepSpec-style config (block_size + target_layer_ids) with architectures={archs!r}: dspark-hf loads "
            f"DeepSpec's DSpark/DFlash drafts {sorted(DEEPSPEC_ARCHITECTURES)} only (EAGLE-3 drafts are a different "
            "method)."
        )
    text = _text_config(cfg)
    _refuse_unsupported(cfg, style)
    rank = int(cfg.get("markov_rank", 0) or 0)
    head_type = cfg.get("markov_head_type", "vanilla")
    rope = rope_parameters_of(text)
    num_heads = cfg["num_attention_heads"]
    fields: dict[str, Any] = {
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or num_heads,
    }
    if style == "gemma4":
        fields.update(_gemma4_shape(cfg, text))
    return DSparkConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]),
        rope_parameters=rope,
        hidden_act=cfg.get("hidden_activation") if style == "gemma4" else cfg.get("hidden_act", "silu"),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        attention_bias=cfg.get("attention_bias", False),
        block_size=cfg["block_size"],
        target_layer_ids=list(cfg["target_layer_ids"]),
        mask_token_id=cfg["mask_token_id"],
        sequential_head=_HEAD_FROM_DEEPSPEC[head_type] if rank else "none",
        markov_rank=rank or 256,
        confidence_head=bool(cfg.get("enable_confidence_head", False)),
        confidence_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
        target_num_hidden_layers=cfg.get("num_target_layers"),
        target_name_or_path=cfg.get("target_name_or_path") or cfg.get("_name_or_path") or None,
        calibration_temperatures=cfg.get("dspark_calibration_temperatures"),
        confidence_calibrated=bool(cfg.get("dspark_confidence_calibrated", False)),
        **fields,
    )


def _load_weights(path_or_repo: str, revision: str | None, token: Any) -> dict[str, torch.Tensor]:
    single = _resolve(path_or_repo, "model.safetensors", revision, token)
    if single is not None:
        return load_file(single)
    index = _resolve(path_or_repo, "model.safetensors.index.json", revision, token)
    if index is None:
        raise ValueError(
            f"{path_or_repo} has a DeepSpec config but no model.safetensors (or sharded index); pickle "
            "checkpoints are not loaded."
        )
    with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(_resolve(path_or_repo, shard, revision, token)))
    return weights


def read_deepspec_checkpoint(
    path_or_repo: str, revision: str | None = None, token: Any = None
) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """Read a DeepSpec-format draft (folder or Hub id) as a [`DSparkConfig`] and the draft's own weights.

    The frozen copies of the target's embedding and LM head are dropped (the draft binds the target's own).
    [`load_deepspec_checkpoint`] builds the model from them.
    """
    path_or_repo = os.fspath(path_or_repo)
    cfg = _read_config(path_or_repo, revision, token)
    if cfg is None or not is_deepspec_config(cfg):
        raise ValueError(
            f"{path_or_repo} is not a DeepSpec-format draft (config.json lacks block_size/target_layer_ids)."
        )
    config = config_from_deepspec(cfg)
    weights = {k.removeprefix("_orig_mod."): v for k, v in _load_weights(path_or_repo, revision, token).items()}
    config.target_weights_fingerprint = fingerprint_copies(weights, source=path_or_repo)
    for name in _TARGET_COPIES:
        weights.pop(name, None)
    return config, weights


def _bind_for_export(draft, target: Any) -> tuple[Any, Any, Any]:
    """Bind `draft` to `target` if one is given; the target (given or bound), its embedding and its LM head."""
    if target is not None:
        draft.bind_target(target)
    target = target or draft.bound_target
    embed, head, _ = draft._require_bound()
    return target, embed, head


def export_deepspec(draft, save_directory: str, target: Any = None, dtype: torch.dtype | None = None) -> str:
    """Write `draft` in DeepSpec's format (what vLLM / SGLang / TensorRT-LLM serve).

    Args:
        draft ([`DSparkDraftModel`]): the draft; its target's embedding and LM head are stored too, as the
            format requires, so it must be bound (or `target` given).
        save_directory (`str`): output folder (created).
        target (`PreTrainedModel`, *optional*): the target; its config is the base of the written config.
            Defaults to the target the draft is bound to.
        dtype (`torch.dtype`, *optional*): dtype of the written weights (DeepSeek's releases use bf16);
            defaults to the draft's dtype.

    Returns:
        `str`: `save_directory`.
    """
    target, embed, head = _bind_for_export(draft, target)
    c = draft.config
    if (c.layer_types is not None and "sliding_attention" in c.layer_types) or not c.sample_from_anchor:
        raise ValueError(
            "DeepSpec's format holds full-attention drafts in the anchor-slot layout; this draft has "
            f"layer_types={c.layer_types} and sample_from_anchor={c.sample_from_anchor}. Export it with "
            "`export_speculators` instead."
        )
    base = target.config.get_text_config().to_dict() if target is not None else {}
    for key in ("auto_map", "quantization_config", "_name_or_path", "transformers_version"):
        base.pop(key, None)
    # transformers reads rope_parameters first; a top-level rope_theta / rope_scaling next to it would only
    # mislead older readers, so the rotary is written once, as the draft computes it.
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        base.pop(key, None)
    base.update(
        architectures=[_ARCHITECTURE_OF_STYLE[c.layer_style]],
        model_type="qwen3",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.attention_bias,
        num_target_layers=c.target_num_hidden_layers,
        block_size=c.block_size,
        target_layer_ids=list(c.target_layer_ids),
        mask_token_id=c.mask_token_id,
        num_anchors=512,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * c.num_hidden_layers,
        enable_confidence_head=c.confidence_head,
        markov_rank=0 if c.sequential_head == "none" else c.markov_rank,
        target_name_or_path=c.target_name_or_path,
        # Not part of DeepSpec's format (servers ignore it); keeps STS calibration across a round trip.
        dspark_calibration_temperatures=list(c.calibration_temperatures),
        dspark_confidence_calibrated=c.confidence_calibrated,
    )
    if c.layer_style == "gemma4":
        _gemma4_export_fields(base, c, target)
    if c.confidence_head:
        base["confidence_head_with_markov"] = c.uses_markov_feature
    if c.sequential_head != "none":
        base["markov_head_type"] = _HEAD_TO_DEEPSPEC[c.sequential_head]
    if draft.draft_vocab_ids is not None:
        warnings.warn(
            f"DeepSpec's format has no draft vocabulary subset: the exported draft proposes from the full "
            f"vocabulary and the subset of {c.draft_vocab_size} ids is dropped. Keep it with "
            "`draft.save_pretrained(...)` (dspark format).",
            UserWarning,
            stacklevel=2,
        )
    return _write_checkpoint(draft, embed, head, base, save_directory, dtype or draft.dtype)


def _write_checkpoint(
    draft, embed: Any, head: Any, config: dict, save_directory: str, dtype: torch.dtype, extra: dict | None = None
) -> str:
    """Write `config.json` and `model.safetensors` as the exchange formats lay them out (DeepSpec's, speculators').

    The weights are the draft's own (less its `draft_vocab_ids` buffer), any `extra` ones, plus copies of the bound
    target's embedding and LM head (`embed_tokens.weight`, `lm_head.weight`), all cast to `dtype`.
    """
    state = {k: v for k, v in draft.state_dict().items() if k != "draft_vocab_ids"} | dict(extra or {})
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    tensors["embed_tokens.weight"] = embed.weight.detach().to(dtype).contiguous().clone()
    tensors["lm_head.weight"] = head.weight.detach().to(dtype).contiguous().clone()
    os.makedirs(save_directory, exist_ok=True)
    save_file(tensors, os.path.join(save_directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(save_directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return save_directory


def _gemma4_export_fields(base: dict, c: DSparkConfig, target: Any) -> None:
    """Rewrite `base` into the Gemma4 text config DeepSpec's `Gemma4DSparkModel` builds its layers from.

    DeepSpec pins transformers 5.10, whose Gemma4 config reads the full-attention shape from `global_head_dim`
    / `num_global_key_value_heads`; newer versions read `per_layer_config`. Both are written, for the draft's
    own layers (all full attention).
    """
    del base["hidden_act"]
    target_rope = target.config.get_text_config().rope_parameters if target is not None else {}
    sliding = target_rope.get("sliding_attention") if isinstance(target_rope, dict) else None
    base.update(
        model_type="gemma4_text",
        target_model_type=target.config.model_type if target is not None else "gemma4",
        target_text_model_type=target.config.get_text_config().model_type if target is not None else "gemma4_text",
        hidden_activation=c.hidden_act,
        global_head_dim=c.head_dim,
        num_global_key_value_heads=c.num_key_value_heads,
        attention_k_eq_v=c.attention_k_eq_v,
        final_logit_softcapping=c.final_logit_softcapping,
        rope_parameters={
            "full_attention": dict(c.rope_parameters),
            "sliding_attention": sliding or {"rope_type": "default", "rope_theta": 10000.0},
        },
        per_layer_config={
            str(i): {"head_dim": c.head_dim, "num_key_value_heads": c.num_key_value_heads}
            for i in range(c.num_hidden_layers)
        },
        # The draft's MLPs all have `intermediate_size`: no KV-shared (double-wide) layers, no MoE, no PLE.
        num_kv_shared_layers=0,
        enable_moe_block=False,
        hidden_size_per_layer_input=0,
    )
