"""Model surgery before training: the draft a run starts from, grown by layers, upgraded with DSpark's heads,
or started from the target's top layers, and the draft vocabulary subset it trains over.

Each change keeps what the draft already predicts (new output projections start at zero) or says what it copied,
so a run starts from a known point (the training guide lists the `dspark train` flags behind each function).
"""

from __future__ import annotations

import copy

import torch

from ..model.modeling import DSparkDraftModel
from ..model.vocab import frequent_token_ids
from .args import LoraArguments, ModelArguments
from .data import TokenDataset


def uncalibrated(draft: DSparkDraftModel) -> DSparkDraftModel:
    """Drop a starting draft's confidence calibration: training changes what the confidences mean, so the
    trained draft is saved as uncalibrated (run `dspark calibrate` on it again) instead of carrying stale
    temperatures that the hardware-aware policy would trust."""
    draft.config.confidence_calibrated = False
    draft.config.calibration_temperatures = [1.0] * draft.config.block_size
    return draft


@torch.no_grad()
def grow_layers(draft: DSparkDraftModel, n: int) -> DSparkDraftModel:
    """Append `n` decoder layers to `draft`, each a copy of its last layer with the output projections of
    attention and MLP zeroed: a zeroed branch adds nothing to the residual stream, so the grown draft's
    predictions are exactly those of `draft` until training moves them (the copied queries, keys and gates
    give the new layers a trained starting point instead of noise). Returns `draft`, grown in place.

    Args:
        draft ([`DSparkDraftModel`]): a draft whose layers are in the standard (`"qwen3"`) style.
        n (`int`): layers to add (`>= 1`).
    """
    if n < 1:
        raise ValueError(f"grow_layers adds at least one layer, got n={n}.")
    if draft.config.layer_style != "qwen3":
        raise ValueError(f"grow_layers grows drafts of the 'qwen3' layer style, not {draft.config.layer_style!r}.")
    last = draft.layers[-1]
    for _ in range(n):
        layer = copy.deepcopy(last)
        layer.self_attn.rotary = last.self_attn.rotary  # one rotary table for all layers, as build_layers makes
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
        draft.layers.append(layer)
    draft.config.num_hidden_layers = len(draft.layers)
    return draft


@torch.no_grad()
def add_heads(
    draft: DSparkDraftModel,
    sequential_head: str = "markov",
    markov_rank: int = 256,
    confidence_head: bool = True,
) -> DSparkDraftModel:
    """Give a draft without a sequential head (a DFlash draft) DSpark's heads: a sequential head of kind
    `sequential_head` and rank `markov_rank`, and a confidence head when `confidence_head`. The sequential
    head's output projection `W2` starts at zero, so its bias `B_k` is zero and the upgraded draft proposes
    exactly what the DFlash draft proposes until training moves it; the rest of the new weights take the
    draft's usual initialisation. The backbone (layers, `fc`, norms) and the draft vocabulary are kept.
    Returns `draft`, changed in place; its config records the heads, so it saves and loads as a DSpark draft.

    Args:
        draft ([`DSparkDraftModel`]): a draft with neither a sequential nor a confidence head.
        sequential_head (`str`, *optional*, defaults to `"markov"`): `"markov"`, `"gated"` or `"rnn"`.
        markov_rank (`int`, *optional*, defaults to 256): the head's rank `r`.
        confidence_head (`bool`, *optional*, defaults to `True`): add a confidence head too.
    """
    from ..model.heads import SEQUENTIAL_HEAD_CLASSES, ConfidenceHead

    has = [f"a {draft.config.sequential_head!r} sequential head"] if draft.markov_head is not None else []
    has += ["a confidence head"] if draft.confidence_head is not None else []
    if has:
        raise ValueError(
            f"add_heads upgrades a draft without heads (a DFlash draft); this one already has {' and '.join(has)}."
        )
    if sequential_head not in SEQUENTIAL_HEAD_CLASSES:
        raise ValueError(
            f"add_heads: sequential_head must be one of {sorted(SEQUENTIAL_HEAD_CLASSES)}, got {sequential_head!r}."
        )
    if markov_rank < 1:
        raise ValueError(f"add_heads: markov_rank must be >= 1, got {markov_rank}.")
    config = draft.config
    config.sequential_head, config.markov_rank, config.confidence_head = sequential_head, markov_rank, confidence_head
    ref = draft.fc.weight
    heads = [SEQUENTIAL_HEAD_CLASSES[sequential_head](config)]
    heads += [ConfidenceHead(config)] if confidence_head else []
    for head in heads:
        head.apply(draft._init_weights)
        head.to(device=ref.device, dtype=ref.dtype)
    heads[0].markov_w2.weight.zero_()
    draft.markov_head = heads[0]
    draft.confidence_head = heads[1] if confidence_head else None
    return uncalibrated(draft)  # a fresh confidence head has no calibration


def init_layers_from_target(draft: DSparkDraftModel, target) -> list[str]:
    """Start a fresh draft's decoder layers from the target's top layers: draft layer `i` of `n` takes the weights
    of target layer `L - n + i` wherever a parameter of the same name and shape exists there (attention and MLP
    projections, both layer norms), and the draft's final norm takes the target's (the draft's hidden states
    feed the target's LM head). Parameters the target layer lacks (a Qwen3-style draft's q/k norms) keep their
    fresh values; target parameters the draft lacks (a Qwen2 target's q/k/v biases) are not used.

    Returns the names of the draft parameters it set. Raises `ValueError` when the target's layers cannot be
    found or no parameter matches (different widths: nothing to copy).
    """
    from .._transformers import decoder_layers

    layers = decoder_layers(target)
    if layers is None:
        raise ValueError(f"init_layers_from_target: cannot find the decoder layers of {type(target).__name__}.")
    n = len(draft.layers)
    if n > len(layers):
        raise ValueError(f"init_layers_from_target: the draft has {n} layers, the target only {len(layers)}.")
    pairs = [(f"layers.{i}.", layers[len(layers) - n + i]) for i in range(n)]
    final_norm = getattr(getattr(target, "model", None), "norm", None)
    if isinstance(final_norm, torch.nn.Module):
        pairs.append(("norm.", final_norm))
    own = dict(draft.named_parameters())
    copied = []
    with torch.no_grad():
        for prefix, module in pairs:
            for name, value in module.named_parameters():
                mine = own.get(prefix + name)
                if mine is not None and mine.shape == value.shape:
                    mine.copy_(value.to(dtype=mine.dtype, device=mine.device))
                    copied.append(prefix + name)
    if not any(name.startswith("layers.") and "_proj." in name for name in copied):
        raise ValueError(
            "init_layers_from_target: no projection of the draft's layers matches the target's in name and shape "
            "(the draft is shaped differently from the target's layers: heads, head size or MLP width)."
        )
    return copied


def build_draft(target, model_args: ModelArguments, lora_args: LoraArguments):
    """The draft a run trains: a LoRA adapter on an `init_from` draft, an `init_from` draft (upgraded with
    [`add_heads`] and grown with [`grow_layers`] when asked), or a fresh draft shaped from the target (its layers
    started from the target's with `init_layers_from_target`). Weights are float32 (the master copy; bf16
    compute comes from the trainer's autocast).

    Args:
        target (`PreTrainedModel`): the frozen target the draft reads.
        model_args ([`ModelArguments`]): the draft's shape, starting point and upgrades.
        lora_args ([`LoraArguments`]): `lora=True` wraps the draft in a peft adapter.
    """
    if lora_args.lora:
        if model_args.init_from is None:
            raise ValueError("LoRA fine-tuning adapts an existing draft: pass --init_from <draft folder or Hub id>.")
        if model_args.add_layers:
            raise ValueError("--add_layers grows the draft's full weights; it cannot be combined with --lora.")
        if model_args.add_heads:
            raise ValueError("--add_heads trains new heads in full; it cannot be combined with --lora.")
        from .lora import apply_lora

        draft = uncalibrated(DSparkDraftModel.from_pretrained(model_args.init_from, target=target).float())
        return apply_lora(draft, lora_args, base_path=model_args.init_from)
    if model_args.init_from is not None:
        draft = uncalibrated(DSparkDraftModel.from_pretrained(model_args.init_from, target=target).float())
        if model_args.add_heads:
            add_heads(draft, model_args.sequential_head, model_args.markov_rank, model_args.confidence_head)
        return grow_layers(draft, model_args.add_layers) if model_args.add_layers else draft
    # fp32 master weights whatever the target's dtype; bf16 compute comes from autocast.
    draft = DSparkDraftModel.from_target(target, **model_args.draft_config_overrides()).float()
    if model_args.init_layers_from_target:
        init_layers_from_target(draft, target)
    return draft


def draft_vocab(model, model_args: ModelArguments, train_ds: TokenDataset, target) -> torch.Tensor | None:
    """The draft vocabulary subset to train over: chosen from the training data for a fresh draft with
    `draft_vocab_size`, or the one an `init_from` draft already carries (`None`: the full vocabulary)."""
    draft = model if isinstance(model, DSparkDraftModel) else model.get_base_model()
    if model_args.draft_vocab_size is not None:
        if model_args.init_from is not None:
            raise ValueError("draft_vocab_size applies to fresh drafts; an --init_from draft keeps its own subset.")
        eos = target.generation_config.eos_token_id
        always = [eos] if isinstance(eos, int) else list(eos or [])
        ids = frequent_token_ids(
            ((ids, mask) for ids, mask in (train_ds[i] for i in range(len(train_ds)))),
            model_args.draft_vocab_size,
            always=always,
            vocab_size=draft.config.vocab_size,
        )
        draft.set_draft_vocab(ids)
    return draft.draft_vocab_ids
