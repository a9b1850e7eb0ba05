"""Import and export of the speculators format (vLLM's `speculators` library: DSpark and DFlash drafts).

A speculators checkpoint is a `config.json` with `speculators_model_type` (`"dspark"`, or `"dflash"`), a
`speculators_config` (algorithm, proposal method, verifier), the draft layers' config as
`transformer_layer_config` (a transformers config whose `num_hidden_layers` is the number of draft layers),
and `model.safetensors`. Its DSpark draft is the same model as DeepSpec's Qwen3 draft (Qwen3-style layers
with context K/V injection, Markov head, confidence head), so the weights are a rename-free copy; the
differences are in the config (`docs/speculators-format.md` has the whole story):

| speculators                              | dspark_hf                                                  |
|------------------------------------------|------------------------------------------------------------|
| `aux_hidden_state_layer_ids` (`a`)       | `target_layer_ids` = `a - 1` (vLLM captures a layer's input) |
| `transformer_layer_config.*`             | shape, `rms_norm_eps`, `hidden_act`, `rope_parameters`       |
| `transformer_layer_config.layer_types`, `sliding_window` | `layer_types`, `sliding_window`            |
| `sliding_window_non_causal`              | same name                                                   |
| `sample_from_anchor`                     | same name; missing: from `speculative_tokens` (see below)   |
| `block_size` (B)                         | `block_size` = B (`sample_from_anchor: true`), B - 1 (false) |
| `mask_token_id`                          | same name                                                   |
| `markov_rank`, `markov_head_type`        | `sequential_head`, `markov_rank` (`0`: none)                 |
| `enable_confidence_head`, `confidence_head_with_markov` | `confidence_head`, `confidence_with_markov` |
| `draft_vocab_size` < vocab, `t2d` / `d2t`| a draft vocabulary subset (`set_draft_vocab`), import only  |
| `speculators_config.verifier.name_or_path` | `target_name_or_path`                                     |

DSpark checkpoints written before speculators' PR #760 have no `sample_from_anchor` and were trained in the
DFlash layout; the layout is then read from the proposal's `speculative_tokens` (`B - 1`: false, `B`: true) with
a one-line note, and a checkpoint where neither tells is refused.

`embed_tokens.weight` and `lm_head.weight` (the verifier's, the latter restricted to the draft vocabulary)
are fingerprinted and dropped on import, like DeepSpec's copies; export writes the bound target's.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .configuration import FULL_ATTENTION, SLIDING_ATTENTION, DSparkConfig
from .fingerprint import fingerprint_copies
from .formats import (
    _HEAD_FROM_DEEPSPEC,
    _HEAD_TO_DEEPSPEC,
    _bind_for_export,
    _load_weights,
    _read_config,
    _write_checkpoint,
)

SPECULATORS_TYPES = ("dspark", "dflash")
_ARCHITECTURES = {"dspark": "DSparkSpeculator", "dflash": "DFlashSpeculator"}
# Weights of the speculators model that are copies of (or derived from) the verifier, or vocabulary maps.
_NOT_DRAFT = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t")


def is_speculators_config(cfg: dict) -> bool:
    """Whether a parsed `config.json` is a speculators DSpark/DFlash draft."""
    return cfg.get("speculators_model_type") in SPECULATORS_TYPES


def is_speculators_checkpoint(path_or_repo: str, revision: str | None = None, token: Any = None) -> bool:
    """Whether `path_or_repo` (folder or Hub id) holds a speculators DSpark/DFlash draft."""
    cfg = _read_config(os.fspath(path_or_repo), revision, token)
    return cfg is not None and is_speculators_config(cfg)


def _layer_config(cfg: dict) -> Any:
    from transformers import AutoConfig

    layer = dict(cfg.get("transformer_layer_config") or {})
    model_type = layer.pop("model_type", "qwen3")
    layer.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **layer)


def _sample_from_anchor(cfg: dict, source: str) -> bool:
    """The block layout of a speculators draft: `sample_from_anchor`, or, where the key is missing (DSpark drafts
    written before speculators' PR #760, 2026-07-13, which all used the DFlash layout), what the proposal's
    `speculative_tokens` says: `block_size - 1` drafted tokens is the DFlash layout, `block_size` the anchor one."""
    value = cfg.get("sample_from_anchor")
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"{source}: sample_from_anchor={value!r} in config.json must be true or false.")
        return value
    block = cfg.get("block_size")
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if isinstance(block, int) and tokens in (block - 1, block):
        layout = "false (the DFlash layout)" if tokens == block - 1 else "true"
        warnings.warn(
            f"{source}: config.json has no sample_from_anchor (written before speculators' PR #760); its "
            f"speculative_tokens={tokens} with block_size={block} says sample_from_anchor={layout}, and it loads so.",
            UserWarning,
            stacklevel=4,
        )
        return tokens == block
    raise ValueError(
        f"{source}: config.json has no sample_from_anchor and its speculative_tokens={tokens!r} with "
        f"block_size={block!r} does not tell the block layout (block_size - 1: false, block_size: true); add "
        '"sample_from_anchor": true or false to config.json.'
    )


def _layer_types(layer: Any, source: str) -> tuple[list[str] | None, int | None]:
    """The draft layers' attention types and window, read as speculators reads them (from the parsed
    `transformer_layer_config`: a Qwen3 config keeps `sliding_window` only with `use_sliding_window`)."""
    types = getattr(layer, "layer_types", None)
    if not types or all(t == FULL_ATTENTION for t in types):
        return None, None
    types = list(types)
    unknown = sorted({t for t in types} - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(
            f"{source}: transformer_layer_config.layer_types has {unknown}; draft layers are "
            f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}."
        )
    if len(types) != layer.num_hidden_layers:
        raise ValueError(
            f"{source}: transformer_layer_config.layer_types has {len(types)} entries for "
            f"num_hidden_layers={layer.num_hidden_layers}."
        )
    window = getattr(layer, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(
            f"{source}: transformer_layer_config has sliding_attention layers but sliding_window={window!r} (a "
            "Qwen3 config keeps it only with use_sliding_window: true); give the window the draft was trained with."
        )
    return types, window


def config_from_speculators(cfg: dict, source: str | None = None) -> DSparkConfig:
    """Translate a speculators DSpark/DFlash `config.json` dict into a [`DSparkConfig`] (full vocabulary).

    speculators' `block_size` is the backbone's block; the config's `block_size` is the number of drafted
    tokens: the same with `sample_from_anchor: true`, one less with `false` (see `docs/speculators-format.md`).

    Raises:
        `ValueError`: (one line, naming the field) for what cannot be interpreted: a layout that neither
            `sample_from_anchor` nor `speculative_tokens` tells, sliding layers without a window, an unknown
            Markov head, a missing `mask_token_id`.
    """
    kind = cfg.get("speculators_model_type")
    source = source or "speculators draft"
    anchor_layout = _sample_from_anchor(cfg, source)
    layer = _layer_config(cfg)
    layer_types, window = _layer_types(layer, source)
    rope = getattr(layer, "rope_parameters", None) or {}
    if isinstance(rope.get("sliding_attention"), dict):  # speculators builds its rotary from this entry
        rope = rope["sliding_attention"]
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(layer, "rope_theta", 10000.0))}
    rope = {k: v for k, v in rope.items() if k != "type"}
    rank = int(cfg.get("markov_rank", 0) or 0) if kind == "dspark" else 0
    if cfg.get("dspark_zero_markov_head"):  # export_speculators' stand-in for no sequential head
        rank = 0
    head_type = cfg.get("markov_head_type", "vanilla")
    if rank and head_type not in _HEAD_FROM_DEEPSPEC:
        raise ValueError(f"{source}: unknown markov_head_type {head_type!r}; supported: {sorted(_HEAD_FROM_DEEPSPEC)}.")
    if int(cfg.get("block_size") or 0) < (1 if anchor_layout else 2):
        raise ValueError(f"{source}: block_size={cfg.get('block_size')!r} leaves no token to draft.")
    confidence = bool(cfg.get("enable_confidence_head", True)) if kind == "dspark" else False
    aux = [int(a) for a in cfg["aux_hidden_state_layer_ids"]]
    if cfg.get("mask_token_id") is None:
        raise ValueError(f"{source}: config.json has no mask_token_id; the block's mask slots cannot be filled.")
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    num_heads = layer.num_attention_heads
    target_hidden = cfg.get("target_hidden_size") or layer.hidden_size
    return DSparkConfig(
        vocab_size=layer.vocab_size,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
        num_hidden_layers=layer.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(layer, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(layer, "head_dim", None) or layer.hidden_size // num_heads,
        rms_norm_eps=layer.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_parameters=rope,
        hidden_act=getattr(layer, "hidden_act", "silu"),
        max_position_embeddings=getattr(layer, "max_position_embeddings", 32768),
        attention_bias=bool(getattr(layer, "attention_bias", False)),
        block_size=int(cfg["block_size"]) - (0 if anchor_layout else 1),
        sample_from_anchor=anchor_layout,
        layer_types=layer_types,
        sliding_window=window,
        sliding_window_non_causal=bool(cfg.get("sliding_window_non_causal", False)),
        target_layer_ids=[a - 1 for a in aux],
        mask_token_id=int(cfg["mask_token_id"]),
        sequential_head=_HEAD_FROM_DEEPSPEC[head_type] if rank else "none",
        markov_rank=rank or 256,
        confidence_head=confidence,
        confidence_with_markov=bool(cfg.get("confidence_head_with_markov", True)) and confidence,
        target_hidden_size=target_hidden,
        target_name_or_path=verifier.get("name_or_path"),
        calibration_temperatures=cfg.get("dspark_calibration_temperatures"),
        confidence_calibrated=bool(cfg.get("dspark_confidence_calibrated", False)),
    )


def _draft_vocab(weights: dict, vocab_size: int, draft_vocab_size: int, source: str) -> torch.Tensor | None:
    """The draft vocabulary subset `S` (target ids, ascending) of a speculators draft, or `None` (full)."""
    if draft_vocab_size == vocab_size:
        return None
    t2d = weights.get("t2d")
    if t2d is None or t2d.numel() != vocab_size:
        raise ValueError(
            f"{source}: draft_vocab_size={draft_vocab_size} < vocab {vocab_size} but no t2d mask over the "
            "vocabulary in the weights; the draft vocabulary cannot be recovered."
        )
    ids = t2d.bool().nonzero().flatten()
    if ids.numel() != draft_vocab_size:
        raise ValueError(f"{source}: t2d selects {ids.numel()} tokens, draft_vocab_size is {draft_vocab_size}.")
    d2t = weights.get("d2t")
    if d2t is not None:  # both conventions exist (target id, or offset target id - draft id); check either
        d2t = d2t.long()
        if not (torch.equal(d2t, ids) or torch.equal(d2t + torch.arange(ids.numel()), ids)):
            raise ValueError(f"{source}: d2t does not map draft ids to the t2d tokens in ascending order.")
    return ids


def read_speculators_checkpoint(
    path_or_repo: str, revision: str | None = None, token: Any = None
) -> tuple[DSparkConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """Read a speculators DSpark/DFlash draft (folder or Hub id): its [`DSparkConfig`], the draft's own weights
    (full-vocabulary shapes) and its draft vocabulary subset (`None`: the full vocabulary).

    The verifier copies and vocabulary maps are dropped; `load_speculators_checkpoint` in
    `dspark_hf.model.modeling` builds the model from the result.
    """
    path_or_repo = os.fspath(path_or_repo)
    cfg = _read_config(path_or_repo, revision, token)
    if cfg is None or not is_speculators_config(cfg):
        raise ValueError(f"{path_or_repo} is not a speculators DSpark/DFlash draft (no speculators_model_type).")
    config = config_from_speculators(cfg, path_or_repo)
    weights = _load_weights(path_or_repo, revision, token)
    ids = _draft_vocab(weights, config.vocab_size, int(cfg.get("draft_vocab_size") or config.vocab_size), path_or_repo)
    copies = {"embed_tokens.weight": weights["embed_tokens.weight"]} if "embed_tokens.weight" in weights else {}
    if ids is None and "lm_head.weight" in weights:
        copies["lm_head.weight"] = weights["lm_head.weight"]
    config.target_weights_fingerprint = fingerprint_copies(copies, source=path_or_repo)
    weights = {k: v for k, v in weights.items() if k not in _NOT_DRAFT}
    if cfg.get("dspark_zero_markov_head"):
        zero = [
            weights.pop(k) for k in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight") if k in weights
        ]
        if len(zero) != 2 or any(w.any() for w in zero):
            raise ValueError(
                f"{path_or_repo}: dspark_zero_markov_head is set but the Markov weights are not the two zero matrices "
                "export_speculators writes; remove the key from config.json to load the head."
            )
    w2 = weights.get("markov_head.markov_w2.weight")
    if ids is not None and w2 is not None:  # W2 covers the draft vocabulary only: rows outside S stay zero
        full = w2.new_zeros(config.vocab_size, w2.shape[1])
        full[ids] = w2
        weights["markov_head.markov_w2.weight"] = full
    return config, weights, ids


def export_speculators(draft, save_directory: str, target: Any = None, dtype: torch.dtype | None = None) -> str:
    """Write `draft` in the speculators format, which `vllm serve` loads (`docs/speculators-format.md`).

    The kind written is [`export_kind`]'s: `dflash` only for a head-less draft in the DFlash layout, else `dspark`
    (a head-less draft in the anchor-slot layout with a zero Markov head, which vLLM's DSpark model needs).

    Args:
        draft ([`DSparkDraftModel`]): a `"qwen3"`-style draft, bound to its target (or `target` given).
        save_directory (`str`): output folder (created).
        target (`PreTrainedModel`, *optional*): the target (verifier); defaults to the bound one. Its name
            (`config.name_or_path`) becomes `speculators_config.verifier.name_or_path`, which `vllm serve DIR`
            uses to load the verifier.
        dtype (`torch.dtype`, *optional*): dtype of the written weights; defaults to the draft's.

    Returns:
        `str`: `save_directory`.
    """
    target, embed, head = _bind_for_export(draft, target)
    _check_exportable(draft)
    c, kind = draft.config, export_kind(draft.config)
    # The config's public `name_or_path`, not `_transformers.model_name` (which falls back to the class name):
    # `vllm serve` loads the verifier by this name, so an unnamed target must stay unnamed.
    verifier_name = c.target_name_or_path or (target.config.name_or_path if target else None)
    out = {
        "architectures": [_ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        "speculators_config": _speculators_config(c, kind, verifier_name, target),
        "transformer_layer_config": _transformer_layer_config(c),
        "draft_vocab_size": c.vocab_size,
        "block_size": c.backbone_slots,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": c.sliding_window_non_causal,
        "sample_from_anchor": c.sample_from_anchor,
        # Not part of the speculators format (loaders ignore it); keeps STS calibration across a round trip.
        "dspark_calibration_temperatures": list(c.calibration_temperatures),
        "dspark_confidence_calibrated": c.confidence_calibrated,
    }
    extra = _dspark_heads(draft, out) if kind == "dspark" else {}
    dtype = dtype or draft.dtype
    out["dtype"] = str(dtype).replace("torch.", "")
    return _write_checkpoint(draft, embed, head, out, save_directory, dtype, extra)


def _check_exportable(draft) -> None:
    """Refuse layers the format cannot hold; warn that a draft vocabulary subset is not exported."""
    c = draft.config
    if c.layer_style != "qwen3" or c.final_logit_softcapping is not None:
        raise ValueError(
            f"The speculators format holds Qwen3-style draft layers; this draft has layer_style={c.layer_style!r}"
            f"{' and logit soft-capping' if c.final_logit_softcapping is not None else ''}. Export it with "
            "`export_deepspec` instead."
        )
    if draft.draft_vocab_ids is not None:
        warnings.warn(
            f"The draft vocabulary subset of {c.draft_vocab_size} ids is not exported (the speculators format's d2t "
            "convention is not fixed across servers): the exported draft proposes from the full vocabulary.",
            UserWarning,
            stacklevel=3,
        )


def _transformer_layer_config(c: DSparkConfig) -> dict[str, Any]:
    """`transformer_layer_config`: the draft layers as a Qwen3 config."""
    layer = {
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": dict(c.rope_parameters),
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "layer_types": [c.layer_type(i) for i in range(c.num_hidden_layers)],
        "tie_word_embeddings": False,
    }
    if c.layer_types is not None and SLIDING_ATTENTION in c.layer_types:  # a Qwen3 config keeps the window only so
        layer.update(sliding_window=c.sliding_window, use_sliding_window=True, max_window_layers=c.num_hidden_layers)
    return layer


def _speculators_config(c: DSparkConfig, kind: str, verifier_name: str | None, target) -> dict[str, Any]:
    """`speculators_config`: the algorithm, a greedy proposal of `block_size` tokens, and the verifier."""
    return {
        "algorithm": kind,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": c.block_size,  # drafted tokens; the block has backbone_slots
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": verifier_name,
            "architectures": list(getattr(target.config, "architectures", None) or []) if target else [],
        },
    }


def _dspark_heads(draft, out: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The `dspark` kind's head fields, set in `out`; returns the extra weights of a head-less draft's stand-in."""
    c = draft.config
    out.update(
        markov_rank=0 if c.sequential_head == "none" else c.markov_rank,
        markov_head_type=_HEAD_TO_DEEPSPEC.get(c.sequential_head, "vanilla"),
        enable_confidence_head=c.confidence_head,
        confidence_head_with_markov=c.uses_markov_feature,
    )
    if c.sequential_head != "none":
        return {}
    # vLLM's DSpark model always builds a Markov head of markov_rank: give it one whose bias is exactly
    # zero (rank 1, zero weights), so the draft proposes what it proposes here; the import drops it again.
    out.update(markov_rank=1, dspark_zero_markov_head=True)
    w1 = draft.fc.weight.new_zeros(c.vocab_size, 1)
    return {"markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w1.clone()}


def export_kind(config: DSparkConfig) -> str:
    """The `speculators_model_type` a draft is exported as, so that vLLM reads the slots it drafts from.

    vLLM's `dflash` path drafts from the mask slots only (the DFlash layout; `sample_from_anchor` is not read
    there), so only a head-less draft in that layout is written as `dflash`. Everything else is `dspark`, whose
    path reads `sample_from_anchor` (vLLM #48639); a head-less draft in the anchor-slot layout gets a zero
    Markov head for it (see `docs/speculators-format.md`).
    """
    heads = config.sequential_head != "none" or config.confidence_head
    return "dflash" if not heads and not config.sample_from_anchor else "dspark"
