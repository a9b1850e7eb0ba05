"""The training loop, built on `accelerate`: the same code runs on a CPU, one GPU, or under
`accelerate launch` with DDP or FSDP. The draft it starts from comes from [`dspark_hf.train.surgery`]; one
micro-batch and the held-out evaluation are [`dspark_hf.train.step`].

Per optimizer step and process: `gradient_accumulation_steps` micro-batches of `per_device_batch_size`
sequences. For each micro-batch the frozen target provides its features (online, or read from a
[`FeatureCache`]), anchors are sampled per sequence, all blocks of a sequence run through the draft in one
forward (each block sees the context before its anchor and itself), and [`dspark_loss`] is back-propagated
into the draft's own parameters only (the target, its embedding and its LM head get no gradient).

Reproducibility: the data order and every anchor are pure functions of (seed, epoch, sequence index), and
checkpoints hold the weights, the optimizer and the scheduler, so a resumed run computes exactly the steps
the interrupted one would have (on CPU, the same losses to the last digit; see `tests/train/test_train_resume.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..model.modeling import DSparkDraftModel
from .args import DataArguments, LoraArguments, ModelArguments, TrainArguments, require
from .checkpoint import gather_states, load_checkpoint, prune_checkpoints, resolve_resume, save_checkpoint
from .data import TokenDataset, load_target, load_token_dataset
from .features import FeatureCache
from .losses import acceptance_estimates
from .step import BlockStep, evaluate
from .surgery import build_draft, draft_vocab

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


@dataclass
class _Run:
    """One run between its steps: what [`train`] sets up and its loop reads and updates."""

    accelerator: Any
    model: Any  # as `accelerator.prepare` returns it (DDP/FSDP-wrapped when distributed)
    optimizer: Any  # accelerate's wrapper around the AdamW optimizer
    scheduler: Any
    trainable: list[str]  # the trainable parameters' names, recorded in checkpoints
    runner: BlockStep
    draft_config: Any
    train_ds: TokenDataset
    eval_ds: TokenDataset | None
    data_args: DataArguments
    train_args: TrainArguments
    out_dir: Path
    run_args: dict[str, Any]
    max_steps: int
    start_step: int = 0
    cost: TrainingCost = field(default_factory=TrainingCost)
    cache: FeatureCache | None = None
    eval_cache: FeatureCache | None = None

    @property
    def raw_optimizer(self):
        """The torch optimizer itself (checkpoints and the LR schedule read it, not accelerate's wrapper)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def _arguments(model_args, data_args, train_args, lora_args):
    """The four argument groups with their defaults, the preset's loss weights filled in, checked."""
    model_args, data_args = model_args or ModelArguments(), data_args or DataArguments()
    train_args, lora_args = train_args or TrainArguments(), lora_args or LoraArguments()
    # The preset fills the loss weights left unset (a copy: the caller's arguments are not modified).
    preset = {k: v for k, v in model_args.loss_weights().items() if getattr(train_args, k) is None}
    train_args = dataclasses.replace(train_args, **preset)
    if train_args.output_dir is None:
        raise ValueError("train() needs TrainArguments.output_dir (--output_dir), where the draft is written.")
    if train_args.report_to == "tensorboard":
        require("tensorboard", "TensorBoard logging (report_to='tensorboard'; use 'none' to skip it)")
    return model_args, data_args, train_args, lora_args


def _setup(accelerator, target, train_ds, eval_ds, args) -> _Run:
    """The draft, its vocabulary subset, the optimizer and LR schedule (prepared by `accelerate`), the step count
    and the micro-batch step; `args` are the four argument groups from [`_arguments`]."""
    model_args, data_args, train_args, lora_args = args
    model = build_draft(target, model_args, lora_args)
    draft_config = model.config if isinstance(model, DSparkDraftModel) else model.get_base_model().config
    vocab_ids = draft_vocab(model, model_args, train_ds, target)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=train_args.learning_rate,
        betas=(train_args.adam_beta1, train_args.adam_beta2),
        weight_decay=train_args.weight_decay,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    global_batch = train_args.per_device_batch_size * accelerator.num_processes * train_args.gradient_accumulation_steps
    max_steps = train_args.max_steps
    if max_steps <= 0:
        max_steps = max(1, math.ceil(train_args.num_train_epochs * len(train_ds) / global_batch))
    from transformers import get_cosine_schedule_with_warmup

    raw_optimizer = getattr(optimizer, "optimizer", optimizer)
    scheduler = get_cosine_schedule_with_warmup(raw_optimizer, round(train_args.warmup_ratio * max_steps), max_steps)
    bf16, device_type = train_args.mixed_precision == "bf16", accelerator.device.type

    def autocast():
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16)

    run_args = {"model": asdict(model_args), "data": asdict(data_args)}
    run_args.update(training=asdict(train_args), lora=asdict(lora_args))
    return _Run(
        accelerator,
        model,
        optimizer,
        scheduler,
        trainable,
        BlockStep(target, draft_config, train_args, autocast, vocab_ids),
        draft_config,
        train_ds,
        eval_ds,
        data_args,
        train_args,
        Path(train_args.output_dir),
        run_args,
        max_steps,
    )


def _resume(run: _Run) -> None:
    """Load the checkpoint to resume from (weights, optimizer, schedule, cost so far), if any, and open the run's
    files: `run_args.json`, and the metrics log, cut back to the checkpoint's step or started empty."""
    resume = resolve_resume(run.train_args.resume_from_checkpoint, run.out_dir)
    if resume is not None:
        state = load_checkpoint(resume, run.model, run.raw_optimizer)
        run.scheduler.load_state_dict(state["scheduler"])
        run.start_step, run.cost = state["step"], TrainingCost(**state.get("cost", {}))
    run.cost.mixed_precision = run.train_args.mixed_precision
    if run.main:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        (run.out_dir / "run_args.json").write_text(json.dumps(run.run_args, indent=2))
        if resume is not None:
            _truncate_metrics(run.out_dir / METRICS_FILE, run.start_step)
        else:
            (run.out_dir / METRICS_FILE).write_text("")
    if run.train_args.report_to == "tensorboard":
        run.accelerator.init_trackers("tensorboard")


def _feature_caches(run: _Run, target) -> None:
    """With `data_args.feature_cache`: the target's features of the training and held-out data, computed once by
    the main process (the others wait, then read them)."""
    if run.data_args.feature_cache is None:
        return
    layer_ids, folder = run.draft_config.target_layer_ids, run.data_args.feature_cache
    progress = run.main and run.train_args.progress
    with run.accelerator.main_process_first():
        run.cache = FeatureCache.build(target, run.train_ds, layer_ids, folder, progress=progress)
        if run.eval_ds is not None:
            run.eval_cache = FeatureCache.build(target, run.eval_ds, layer_ids, folder, progress=progress)


def _accumulate(run: _Run, step: int) -> torch.Tensor:
    """The micro-batches of optimizer step `step`, back-propagated (gradients synchronised on the last only);
    returns their summed stats: mean loss, ce, l1, bce; tokens, slots; per-slot TV sums and counts."""
    accelerator, a = run.accelerator, run.train_args
    world, rank = accelerator.num_processes, accelerator.process_index
    batch, accum = a.per_device_batch_size, a.gradient_accumulation_steps
    stats = torch.zeros(6 + 2 * run.draft_config.block_size, dtype=torch.float64, device=accelerator.device)
    for micro in range(accum):
        items = micro_batch_items(step, micro, rank, world, batch, accum, len(run.train_ds), a.seed)
        sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(run.model)
        with sync:
            out, n_tokens = run.runner(run.model, run.train_ds, run.cache, items, run.data_args.num_anchors)
            accelerator.backward(out.loss / accum)
        stats += torch.cat(
            [
                torch.stack([out.loss.detach(), out.ce, out.l1, out.bce]).double() / accum,
                torch.tensor([n_tokens, float(out.count.sum())], dtype=torch.float64, device=stats.device),
                out.tv_sum.double(),
                out.count.double(),
            ]
        ).to(stats.device)
    return stats


def _train_step(run: _Run, step: int) -> dict[str, float]:
    """One optimizer step (micro-batches, clipping, optimizer and schedule); adds it to the run's cost and returns
    its metrics, reduced over processes."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    stats = _accumulate(run, step)
    max_norm, accelerator = run.train_args.max_grad_norm, run.accelerator
    grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), max_norm) if max_norm > 0 else None
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    stats[:4] = accelerator.reduce(stats[:4], reduction="mean")
    stats[4:] = accelerator.reduce(stats[4:], reduction="sum")
    elapsed = time.perf_counter() - t0
    run.cost.add(float(stats[4]), float(stats[5]), elapsed, time.process_time() - cpu0)
    gamma = run.draft_config.block_size
    return {
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


def _log(run: _Run, split: str, step: int, metrics: dict[str, float]) -> None:
    """Metrics to the tracker (`<split>/<name>`) and, on the main process, a line of `metrics.jsonl`."""
    run.accelerator.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)
    if run.main:
        with (run.out_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")


def _run_eval(run: _Run, step: int) -> dict[str, float] | None:
    """The held-out evaluation at `step`, logged (`None` without held-out data)."""
    if run.eval_ds is None:
        return None
    anchors = run.data_args.eval_num_anchors or run.data_args.num_anchors
    batch = run.train_args.per_device_batch_size
    metrics = evaluate(run.model, run.runner, run.eval_ds, run.eval_cache, run.accelerator, batch, anchors)
    _log(run, "eval", step, metrics)
    return metrics


def _after_step(run: _Run, done: int, metrics: dict[str, float], bar, callbacks) -> None:
    """What follows optimizer step `done`: logging, the progress bar, evaluation and a checkpoint when due, and
    the callbacks."""
    a = run.train_args
    if done % a.logging_steps == 0 or done == run.max_steps:
        _log(run, "train", done, metrics)
    bar.update(1)
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", tau_est=f"{metrics['tau_est']:.2f}")
    if a.eval_steps and done % a.eval_steps == 0 and done < run.max_steps:
        _run_eval(run, done)
    if a.save_steps and done % a.save_steps == 0 and done < run.max_steps:
        _save(run, done)
    for callback in callbacks:
        callback(TrainState(step=done, max_steps=run.max_steps, metrics=metrics, output_dir=str(run.out_dir)))


def _save(run: _Run, step: int) -> None:
    """Checkpoint `checkpoint-<step>` (every process gathers; the main one writes and prunes old ones)."""
    accelerator, folder = run.accelerator, run.out_dir / f"checkpoint-{step}"
    model_sd, optim_sd = gather_states(run.model, run.raw_optimizer)  # collective: every process takes part
    if accelerator.is_main_process:
        extra = {"args": run.run_args, "cost": asdict(run.cost)}
        unwrapped = accelerator.unwrap_model(run.model)
        save_checkpoint(folder, unwrapped, model_sd, optim_sd, run.trainable, run.scheduler.state_dict(), step, extra)
        prune_checkpoints(folder.parent, run.train_args.save_total_limit)
    accelerator.wait_for_everyone()


def _finish(run: _Run, eval_metrics: dict[str, float] | None):
    """Write the trained draft (or adapter), `eval_results.json` and `training_cost.json`; end the run. Returns
    the unwrapped model."""
    model_sd, _ = gather_states(run.model, run.raw_optimizer)  # collective: every process takes part
    unwrapped = run.accelerator.unwrap_model(run.model)
    if run.main:
        unwrapped.save_pretrained(run.out_dir, state_dict=model_sd, safe_serialization=True)
        if eval_metrics is not None:
            (run.out_dir / "eval_results.json").write_text(json.dumps(eval_metrics, indent=2))
        (run.out_dir / COST_FILE).write_text(json.dumps(run.cost.summary(), indent=2))
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return unwrapped


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
    # 1. The arguments, with their defaults and the preset's loss weights.
    model_args, data_args, train_args, lora_args = _arguments(model_args, data_args, train_args, lora_args)
    # 2. The accelerator and the seed. Precision is applied by our own autocast (BlockStep), not by
    #    Accelerator(mixed_precision=...): accelerate's process-global state refuses a second Accelerator with
    #    another precision in the same process.
    log_with = "tensorboard" if train_args.report_to == "tensorboard" else None
    accelerator = accelerate.Accelerator(log_with=log_with, project_dir=str(Path(train_args.output_dir)))
    accelerate.utils.set_seed(train_args.seed)
    # 3. The frozen target and the data.
    if target is None:
        target, _ = load_target(model_args.target, model_args.target_dtype, str(accelerator.device))
    target = target.to(accelerator.device).eval().requires_grad_(False)
    train_ds, eval_ds = _datasets(data_args, train_args.seed, train_dataset, eval_dataset)
    # 4. The draft (fresh, grown, upgraded or an adapter), its optimizer and schedule, the micro-batch step.
    run = _setup(accelerator, target, train_ds, eval_ds, (model_args, data_args, train_args, lora_args))
    # 5. Resume from a checkpoint, if any; the run's files.
    _resume(run)
    # 6. The target's features, cached once when asked.
    _feature_caches(run, target)
    # 7. The steps, each followed by logging, evaluation and a checkpoint when due, and the callbacks.
    from tqdm.auto import tqdm

    show = run.main and train_args.progress
    bar = tqdm(total=run.max_steps, initial=run.start_step, desc="training", disable=not show)
    run.model.train()
    for step in range(run.start_step, run.max_steps):
        _after_step(run, step + 1, _train_step(run, step), bar, callbacks)
    bar.close()
    # 8. The final evaluation; the draft, its results and its cost written.
    eval_metrics = _run_eval(run, run.max_steps)
    model = _finish(run, eval_metrics)
    return TrainResult(model, str(run.out_dir), run.max_steps, eval_metrics, run.main, run.cost)
