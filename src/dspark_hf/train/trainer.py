"""The training loop, built on `accelerate`: the same code runs on a CPU, one GPU, or under
`accelerate launch` with DDP or FSDP.

Per optimizer step and process: `gradient_accumulation_steps` micro-batches of `per_device_batch_size`
sequences. For each micro-batch the frozen target provides its features (online, or read from a
[`FeatureCache`]), anchors are sampled per sequence, all blocks of a sequence run through the draft in one
forward (each block sees the context before its anchor and itself), and [`dspark_loss`] is back-propagated
into the draft's own parameters only (the target, its embedding and its LM head get no gradient).

Reproducibility: the data order and every anchor are pure functions of (seed, epoch, sequence index), and
checkpoints hold the weights, the optimizer and the scheduler, so a resumed run computes exactly the steps
the interrupted one would have (on CPU, the same losses to the last digit; see `tests/test_train_resume.py`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.modeling import DSparkDraftModel, block_attention_mask
from ..model.vocab import frequent_token_ids
from .args import DataArguments, LoraArguments, ModelArguments, TrainArguments, require
from .checkpoint import gather_states, load_checkpoint, prune_checkpoints, resolve_resume, save_checkpoint
from .data import TokenDataset, load_target, load_token_dataset
from .features import FeatureCache, log_partition_at, pad_features, target_features, target_logits
from .losses import IGNORE_INDEX, Blocks, LossOutput, acceptance_estimates, build_blocks, dspark_loss, sample_anchors

METRICS_FILE = "metrics.jsonl"
COST_FILE = "training_cost.json"


@dataclass
class TrainState:
    """What callbacks receive after every optimizer step.

    Args:
        step (`int`): optimizer steps done.
        max_steps (`int`): steps of the whole run.
        metrics (`dict[str, float]`): this step's training metrics (loss, ce, l1, bce, lr, grad_norm, …).
        output_dir (`str`): the run's output folder.
    """

    step: int
    max_steps: int
    metrics: dict[str, float]
    output_dir: str


@dataclass
class TrainingCost:
    """What a run has cost so far, summed over every resumed part (kept in each checkpoint's trainer state and
    written to `training_cost.json` beside the draft).

    Args:
        steps (`int`): optimizer steps.
        tokens (`int`): context tokens the drafts were trained on (all processes).
        slots (`int`): drafted block slots supervised (all processes).
        cpu_seconds (`float`): CPU time of the main process (all its threads), in training steps.
        wall_seconds (`float`): wall-clock time in training steps (feature caching and evaluation excluded).
        mixed_precision (`str`): the precision the steps ran in (the last part's, if resumed with another).
    """

    steps: int = 0
    tokens: int = 0
    slots: int = 0
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    mixed_precision: str = "no"

    def add(self, tokens: float, slots: float, wall: float, cpu: float) -> None:
        self.steps += 1
        self.tokens += int(tokens)
        self.slots += int(slots)
        self.wall_seconds += wall
        self.cpu_seconds += cpu

    def summary(self) -> dict[str, Any]:
        """The fields plus throughput: tokens per wall second and per CPU minute."""
        return {
            **asdict(self),
            "tokens_per_s": self.tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "cpu_minutes": self.cpu_seconds / 60,
        }


@dataclass
class TrainResult:
    """What [`train`] returns.

    Args:
        model (`DSparkDraftModel` or `PeftModel`): the trained draft (unwrapped from DDP/FSDP).
        output_dir (`str`): where the final draft (or adapter), checkpoints and logs were written.
        global_step (`int`): optimizer steps done.
        eval_metrics (`dict[str, float]`, *optional*): the final held-out evaluation.
        is_main_process (`bool`): whether this process is the main one (the one that writes files).
        cost ([`TrainingCost`], *optional*): tokens, steps and time, cumulative over resumed parts.
    """

    model: Any
    output_dir: str
    global_step: int
    eval_metrics: dict[str, float] | None
    is_main_process: bool = True
    cost: TrainingCost | None = None


def anchor_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of the anchors of sequence `index` in `epoch` (epoch `-1`: the fixed held-out anchors)."""
    return (seed * 1_000_003 + (epoch + 1) * 7_919 + index * 104_729) % (2**63 - 1)


def sample_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The dataset permutation of `epoch`."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def micro_batch_items(
    step: int, micro: int, rank: int, world: int, batch: int, accum: int, num_samples: int, seed: int
) -> list[tuple[int, int]]:
    """`(dataset index, epoch)` of the sequences process `rank` trains on in micro-batch `micro` of `step`.

    The data is one endless stream of epochs, each a fresh permutation; step `s` consumes positions
    `s·G … (s+1)·G − 1` of it (`G = batch·world·accum`), interleaved over processes.
    """
    items = []
    cache: dict[int, list[int]] = {}
    for b in range(batch):
        pos = step * batch * world * accum + (micro * world + rank) * batch + b
        epoch, offset = divmod(pos, num_samples)
        if epoch not in cache:
            cache[epoch] = sample_order(num_samples, seed, epoch)
        items.append((cache[epoch][offset], epoch))
    return items


def forward_blocks(model, context: torch.Tensor, blocks: Blocks, restrict_vocab: bool = False):
    """The draft's teacher-forced forward over `blocks` (from [`build_blocks`]) packed in one pass, each block
    seeing the target context before its anchor and its own block ([`block_attention_mask`]).

    Args:
        model: a [`DSparkDraftModel`] (or a PEFT model around one).
        context (`torch.Tensor` of shape `(B, T, m·d)`): the target's selected-layer features of the sequences.
        blocks ([`Blocks`]): the blocks to draft.
        restrict_vocab (`bool`, *optional*, defaults to `False`): logits over the draft vocabulary subset only.
    """
    block_size = blocks.input_ids.shape[1] // blocks.anchors.shape[1]
    return model(
        target_hidden_states=context,
        input_ids=blocks.input_ids,
        position_ids=blocks.position_ids,
        prev_token_ids=blocks.prev_token_ids,
        attention_mask=block_attention_mask(blocks.anchors, context.shape[1], block_size),
        **({"restrict_vocab": True} if restrict_vocab else {}),
    )


class _BlockStep:
    """Builds one micro-batch (features, anchors, blocks) and computes its loss."""

    def __init__(self, target, draft_config, train_args: TrainArguments, autocast, vocab_ids=None):
        self.target = target
        self.gamma = draft_config.block_size
        self.mask_token_id = draft_config.mask_token_id
        self.layer_ids = list(draft_config.target_layer_ids)
        self.train_args = train_args
        self.autocast = autocast
        # With a draft vocabulary subset S: logits of draft and target over S only, labels as indices into S.
        self.vocab_ids = vocab_ids
        self.label_index = None
        if vocab_ids is not None:
            self.label_index = torch.full((draft_config.vocab_size,), IGNORE_INDEX, dtype=torch.long)
            self.label_index[vocab_ids.cpu()] = torch.arange(vocab_ids.numel())

    def __call__(
        self, model, dataset: TokenDataset, cache: FeatureCache | None, items: list[tuple[int, int]], num_anchors: int
    ) -> tuple[LossOutput, int]:
        device = self.target.device
        seqs = [dataset[i] for i, _ in items]
        length = max(ids.numel() for ids, _ in seqs)
        input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
        loss_mask = torch.zeros(len(seqs), length, dtype=torch.bool)
        attention = torch.zeros(len(seqs), length, dtype=torch.long)
        for b, (ids, mask) in enumerate(seqs):
            input_ids[b, : ids.numel()], loss_mask[b, : ids.numel()], attention[b, : ids.numel()] = ids, mask, 1
        anchors = [
            sample_anchors(mask, num_anchors, torch.Generator().manual_seed(anchor_seed(self.train_args.seed, e, i)))
            for (i, e), (_, mask) in zip(items, seqs)
        ]
        input_ids, loss_mask, attention = input_ids.to(device), loss_mask.to(device), attention.to(device)
        if cache is None:
            feats = target_features(self.target, self.layer_ids, input_ids, attention)
        else:
            feats = pad_features([cache.get(i) for i, _ in items], length)
            feats.context, feats.final = feats.context.to(device), feats.final.to(device)
            if feats.log_partition is not None:
                feats.log_partition = feats.log_partition.to(device)
        blocks = build_blocks(input_ids, loss_mask, anchors, self.gamma, self.mask_token_id)
        subset = self.vocab_ids is not None
        with self.autocast():
            out = forward_blocks(model, feats.context, blocks, restrict_vocab=subset)
        t_logits = target_logits(self.target, feats.final, blocks.target_positions, self.vocab_ids)
        # Over a subset, the full vocabulary's log-partition makes p the target's full distribution on it
        # (a feature cache stored it per token; online it is computed at the trained positions).
        log_z = log_partition_at(feats, self.target, blocks.target_positions) if subset else None
        labels = self.label_index.to(blocks.labels.device)[blocks.labels] if subset else blocks.labels
        a = self.train_args
        loss = dspark_loss(
            out.logits,
            t_logits,
            labels,
            blocks.valid,
            out.confidence_logits,
            block_size=self.gamma,
            target_log_partition=log_z,
            decay=a.loss_decay,
            ce_weight=a.ce_weight,
            l1_weight=a.l1_weight,
            bce_weight=a.bce_weight,
        )
        return loss, int(attention.sum())


def _uncalibrated(draft: DSparkDraftModel) -> DSparkDraftModel:
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
    return _uncalibrated(draft)  # a fresh confidence head has no calibration


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


def _build_model(target, model_args: ModelArguments, lora_args: LoraArguments):
    if lora_args.lora:
        if model_args.init_from is None:
            raise ValueError("LoRA fine-tuning adapts an existing draft: pass --init_from <draft folder or Hub id>.")
        if model_args.add_layers:
            raise ValueError("--add_layers grows the draft's full weights; it cannot be combined with --lora.")
        if model_args.add_heads:
            raise ValueError("--add_heads trains new heads in full; it cannot be combined with --lora.")
        from .lora import apply_lora

        draft = _uncalibrated(DSparkDraftModel.from_pretrained(model_args.init_from, target=target).float())
        return apply_lora(draft, lora_args, base_path=model_args.init_from)
    if model_args.init_from is not None:
        draft = _uncalibrated(DSparkDraftModel.from_pretrained(model_args.init_from, target=target).float())
        if model_args.add_heads:
            add_heads(draft, model_args.sequential_head, model_args.markov_rank, model_args.confidence_head)
        return grow_layers(draft, model_args.add_layers) if model_args.add_layers else draft
    # fp32 master weights whatever the target's dtype; bf16 compute comes from autocast.
    draft = DSparkDraftModel.from_target(target, **model_args.draft_config_overrides()).float()
    if model_args.init_layers_from_target:
        init_layers_from_target(draft, target)
    return draft


def _draft_vocab(model, model_args: ModelArguments, train_ds: TokenDataset, target) -> torch.Tensor | None:
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


def _datasets(data_args: DataArguments, seed: int, train_dataset, eval_dataset):
    if train_dataset is None:
        if data_args.train_data is None:
            raise ValueError("No training data: pass --train_data <JSONL from `dspark prepare-data`>.")
        train_dataset = load_token_dataset(data_args.train_data, data_args.max_seq_len)
    if eval_dataset is None:
        if data_args.eval_data is not None:
            eval_dataset = load_token_dataset(data_args.eval_data, data_args.max_seq_len)
        else:
            train_dataset, eval_dataset = train_dataset.split(data_args.eval_ratio, seed)
    return train_dataset, eval_dataset


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep only metric lines up to `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def evaluate(
    model,
    runner: _BlockStep,
    dataset: TokenDataset,
    cache: FeatureCache | None,
    accelerator,
    batch_size: int,
    num_anchors: int,
) -> dict[str, float]:
    """Weighted losses, `accept@k` and `τ_est` on held-out data (fixed anchors, so evaluations are comparable).

    Every process evaluates its share; sums are reduced across processes. Processes with fewer sequences run
    dummy batches with zero weight, so collective forwards (FSDP) stay in step.
    """
    gamma = runner.gamma
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(dataset), world))
    num_batches = math.ceil(math.ceil(len(dataset) / world) / batch_size)
    sums = torch.zeros(4 + 2 * gamma, dtype=torch.float64, device=accelerator.device)
    model.eval()
    with torch.no_grad():
        for j in range(num_batches):
            chunk = mine[j * batch_size : (j + 1) * batch_size]
            scale = 1.0 if chunk else 0.0
            items = [(i, -1) for i in (chunk or [0])]
            out, _ = runner(model, dataset, cache, items, num_anchors)
            w = out.weight_sum.double()
            part = torch.cat(
                [
                    torch.stack([out.ce * w, out.l1 * w, out.bce * w, w]).double(),
                    out.tv_sum.double(),
                    out.count.double(),
                ]
            )
            sums += scale * part.to(sums.device)
    model.train()
    sums = accelerator.reduce(sums, reduction="sum")
    w = sums[3].clamp(min=1e-12)
    a = runner.train_args
    ce, l1, bce = (float(sums[i] / w) for i in range(3))
    metrics = {"loss": a.ce_weight * ce + a.l1_weight * l1 + a.bce_weight * bce, "ce": ce, "l1": l1, "bce": bce}
    metrics.update(acceptance_estimates(sums[4 : 4 + gamma].float(), sums[4 + gamma :].float()))
    return metrics


def train(
    model_args: ModelArguments | None = None,
    data_args: DataArguments | None = None,
    train_args: TrainArguments | None = None,
    lora_args: LoraArguments | None = None,
    *,
    target=None,
    train_dataset: TokenDataset | None = None,
    eval_dataset: TokenDataset | None = None,
    callbacks: Sequence[Callable[[TrainState], None]] = (),
) -> TrainResult:
    """Train a DSpark (or DFlash) draft, or a LoRA adapter on one. The Python API behind `dspark train`.

    Args:
        model_args ([`ModelArguments`], *optional*): target, draft shape or starting draft, preset.
        data_args ([`DataArguments`], *optional*): data files, anchors, feature cache.
        train_args ([`TrainArguments`]): optimisation, logging, checkpointing; `output_dir` is required.
        lora_args ([`LoraArguments`], *optional*): LoRA options (`lora=True` trains an adapter).
        target (`PreTrainedModel`, *optional*): an already loaded target (else loaded from `model_args`).
        train_dataset ([`TokenDataset`], *optional*): instead of `data_args.train_data`.
        eval_dataset ([`TokenDataset`], *optional*): instead of `data_args.eval_data` / the held-out split.
        callbacks (`Sequence[Callable[[TrainState], None]]`, *optional*): called after every optimizer step.

    Returns:
        [`TrainResult`]
    """
    accelerate = require("accelerate")
    model_args, data_args = model_args or ModelArguments(), data_args or DataArguments()
    train_args, lora_args = train_args or TrainArguments(), lora_args or LoraArguments()
    # The preset fills the loss weights left unset (a copy: the caller's arguments are not modified).
    preset = {k: v for k, v in model_args.loss_weights().items() if getattr(train_args, k) is None}
    train_args = dataclasses.replace(train_args, **preset)
    if train_args.output_dir is None:
        raise ValueError("train() needs TrainArguments.output_dir (--output_dir), where the draft is written.")
    if train_args.report_to == "tensorboard":
        require("tensorboard", "TensorBoard logging (report_to='tensorboard'; use 'none' to skip it)")
    out_dir = Path(train_args.output_dir)
    # Precision is applied by our own autocast (below), not by Accelerator(mixed_precision=...): accelerate's
    # process-global state refuses a second Accelerator with another precision in the same process.
    accelerator = accelerate.Accelerator(
        log_with="tensorboard" if train_args.report_to == "tensorboard" else None, project_dir=str(out_dir)
    )
    main = accelerator.is_main_process
    accelerate.utils.set_seed(train_args.seed)
    if target is None:
        target, _ = load_target(model_args.target, model_args.target_dtype, str(accelerator.device))
    target = target.to(accelerator.device).eval().requires_grad_(False)
    train_ds, eval_ds = _datasets(data_args, train_args.seed, train_dataset, eval_dataset)

    model = _build_model(target, model_args, lora_args)
    draft_config = model.config if isinstance(model, DSparkDraftModel) else model.get_base_model().config
    vocab_ids = _draft_vocab(model, model_args, train_ds, target)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=train_args.learning_rate,
        betas=(train_args.adam_beta1, train_args.adam_beta2),
        weight_decay=train_args.weight_decay,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)

    world, rank = accelerator.num_processes, accelerator.process_index
    batch, accum = train_args.per_device_batch_size, train_args.gradient_accumulation_steps
    global_batch = batch * world * accum
    max_steps = train_args.max_steps
    if max_steps <= 0:
        max_steps = max(1, math.ceil(train_args.num_train_epochs * len(train_ds) / global_batch))
    from transformers import get_cosine_schedule_with_warmup

    scheduler = get_cosine_schedule_with_warmup(raw_optimizer, round(train_args.warmup_ratio * max_steps), max_steps)

    run_args = {
        "model": asdict(model_args),
        "data": asdict(data_args),
        "training": asdict(train_args),
        "lora": asdict(lora_args),
    }
    start_step, cost = 0, TrainingCost()
    resume = resolve_resume(train_args.resume_from_checkpoint, out_dir)
    if resume is not None:
        state = load_checkpoint(resume, model, raw_optimizer)
        scheduler.load_state_dict(state["scheduler"])
        start_step, cost = state["step"], TrainingCost(**state.get("cost", {}))
    cost.mixed_precision = train_args.mixed_precision
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "run_args.json").write_text(json.dumps(run_args, indent=2))
        if resume is not None:
            _truncate_metrics(out_dir / METRICS_FILE, start_step)
        else:
            (out_dir / METRICS_FILE).write_text("")
    if train_args.report_to == "tensorboard":
        accelerator.init_trackers("tensorboard")

    cache = eval_cache = None
    if data_args.feature_cache is not None:
        with accelerator.main_process_first():
            cache = FeatureCache.build(
                target,
                train_ds,
                draft_config.target_layer_ids,
                data_args.feature_cache,
                progress=main and train_args.progress,
            )
            if eval_ds is not None:
                eval_cache = FeatureCache.build(
                    target,
                    eval_ds,
                    draft_config.target_layer_ids,
                    data_args.feature_cache,
                    progress=main and train_args.progress,
                )

    bf16 = train_args.mixed_precision == "bf16"
    device_type = accelerator.device.type

    def autocast():
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16)

    runner = _BlockStep(target, draft_config, train_args, autocast, vocab_ids)
    eval_anchors = data_args.eval_num_anchors or data_args.num_anchors

    def run_eval(step: int) -> dict[str, float] | None:
        if eval_ds is None:
            return None
        metrics = evaluate(model, runner, eval_ds, eval_cache, accelerator, batch, eval_anchors)
        accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        if main:
            with (out_dir / METRICS_FILE).open("a") as f:
                f.write(json.dumps({"step": step, "split": "eval", **metrics}) + "\n")
        return metrics

    from tqdm.auto import tqdm

    bar = tqdm(total=max_steps, initial=start_step, desc="training", disable=not (main and train_args.progress))
    model.train()
    eval_metrics = None
    gamma = draft_config.block_size
    for step in range(start_step, max_steps):
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = torch.zeros(6 + 2 * gamma, dtype=torch.float64, device=accelerator.device)
        for micro in range(accum):
            items = micro_batch_items(step, micro, rank, world, batch, accum, len(train_ds), train_args.seed)
            sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(model)
            with sync:
                out, n_tokens = runner(model, train_ds, cache, items, data_args.num_anchors)
                accelerator.backward(out.loss / accum)
            stats += torch.cat(
                [
                    torch.stack([out.loss.detach(), out.ce, out.l1, out.bce]).double() / accum,
                    torch.tensor([n_tokens, float(out.count.sum())], dtype=torch.float64, device=stats.device),
                    out.tv_sum.double(),
                    out.count.double(),
                ]
            ).to(stats.device)
        grad_norm = (
            accelerator.clip_grad_norm_(model.parameters(), train_args.max_grad_norm)
            if train_args.max_grad_norm > 0
            else None
        )
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        stats[:4] = accelerator.reduce(stats[:4], reduction="mean")
        stats[4:] = accelerator.reduce(stats[4:], reduction="sum")
        elapsed = time.perf_counter() - t0
        cost.add(float(stats[4]), float(stats[5]), elapsed, time.process_time() - cpu0)
        metrics = {
            "loss": float(stats[0]),
            "ce": float(stats[1]),
            "l1": float(stats[2]),
            "bce": float(stats[3]),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens_per_s": float(stats[4]) / elapsed,
            "slots_per_s": float(stats[5]) / elapsed,
            "tau_est": acceptance_estimates(stats[6 : 6 + gamma].float(), stats[6 + gamma :].float())["tau_est"],
        }
        if done % train_args.logging_steps == 0 or done == max_steps:
            accelerator.log({f"train/{k}": v for k, v in metrics.items()}, step=done)
            if main:
                with (out_dir / METRICS_FILE).open("a") as f:
                    f.write(json.dumps({"step": done, "split": "train", **metrics}) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", tau_est=f"{metrics['tau_est']:.2f}")
        if train_args.eval_steps and done % train_args.eval_steps == 0 and done < max_steps:
            run_eval(done)
        if train_args.save_steps and done % train_args.save_steps == 0 and done < max_steps:
            _save(
                accelerator,
                model,
                raw_optimizer,
                scheduler,
                trainable,
                out_dir / f"checkpoint-{done}",
                done,
                {"args": run_args, "cost": asdict(cost)},
                train_args.save_total_limit,
            )
        for callback in callbacks:
            callback(TrainState(step=done, max_steps=max_steps, metrics=metrics, output_dir=str(out_dir)))
    bar.close()
    eval_metrics = run_eval(max_steps)
    model_sd, _ = gather_states(model, raw_optimizer)
    unwrapped = accelerator.unwrap_model(model)
    if main:
        unwrapped.save_pretrained(out_dir, state_dict=model_sd, safe_serialization=True)
        if eval_metrics is not None:
            (out_dir / "eval_results.json").write_text(json.dumps(eval_metrics, indent=2))
        (out_dir / COST_FILE).write_text(json.dumps(cost.summary(), indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(
        model=unwrapped,
        output_dir=str(out_dir),
        global_step=max_steps,
        eval_metrics=eval_metrics,
        is_main_process=main,
        cost=cost,
    )


def _save(accelerator, model, optimizer, scheduler, trainable, folder: Path, step: int, extra, keep) -> None:
    model_sd, optim_sd = gather_states(model, optimizer)  # collective: every process takes part
    if accelerator.is_main_process:
        save_checkpoint(
            folder,
            accelerator.unwrap_model(model),
            model_sd,
            optim_sd,
            trainable,
            scheduler.state_dict(),
            step,
            extra,
        )
        prune_checkpoints(folder.parent, keep)
    accelerator.wait_for_everyone()
