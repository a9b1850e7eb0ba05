"""Training checkpoints: atomic, safetensors-only, and complete enough for an exact resume.

A checkpoint folder `checkpoint-<step>/` holds

* the draft as `save_pretrained` writes it (`config.json` + `model.safetensors`), or, for LoRA runs, the
  adapter (`adapter_config.json` + `adapter_model.safetensors`) plus `trainable.safetensors` with the
  trainable tensors under their training-time names: either way a usable model, not just a resume blob;
* `optimizer.safetensors`: every optimizer state tensor, keyed `<parameter name>/<state name>`;
* `trainer_state.json`: the step, the optimizer's parameter groups, the LR scheduler's state and the run's
  arguments.

Nothing is pickled. Data order and anchors are pure functions of (seed, epoch, sequence index), so no RNG
state needs saving. Model and optimizer states are gathered with `torch.distributed.checkpoint`'s
full-state-dict API, which treats plain, DDP and FSDP models alike.

The folder is written as `.tmp-checkpoint-<step>` and renamed when complete, so a process killed while
saving leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_CKPT = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def _options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def gather_states(model, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full (unsharded, CPU) model and optimizer state dicts, keyed by parameter name. Collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(model, options=_options(cpu_offload=True))
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return model_sd, optim_sd


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(
    folder: str | os.PathLike,
    unwrapped_model,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any],
    trainable: list[str],
    scheduler_state: dict[str, Any],
    step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `folder` (e.g. `out/checkpoint-100`) atomically. Call on the main process only.

    Args:
        folder (`str` or `os.PathLike`): the final checkpoint folder.
        unwrapped_model (`PreTrainedModel` or `PeftModel`): the draft being trained (for `save_pretrained`).
        model_sd (`dict[str, torch.Tensor]`): its full state dict, from [`gather_states`].
        optim_sd (`dict`): the optimizer's full state dict, from [`gather_states`].
        trainable (`list[str]`): names of the trained parameters.
        scheduler_state (`dict`): `scheduler.state_dict()`.
        step (`int`): optimizer steps done.
        extra (`dict`, *optional*): more JSON-ready data for `trainer_state.json` (e.g. the arguments).
    """
    from safetensors.torch import save_file

    final = Path(folder)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    is_peft = hasattr(unwrapped_model, "peft_config")
    unwrapped_model.save_pretrained(tmp, state_dict=model_sd, safe_serialization=True)
    if is_peft:
        save_file({n: model_sd[n].contiguous() for n in trainable}, tmp / "trainable.safetensors")
    tensors = {
        f"{name}/{key}": value.contiguous()
        for name, st in optim_sd["state"].items()
        for key, value in st.items()
        if isinstance(value, torch.Tensor)
    }
    save_file(tensors, tmp / "optimizer.safetensors")
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]]
    state = {"step": step, "param_groups": groups, "scheduler": scheduler_state, **(extra or {})}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    _fsync_tree(tmp)
    if final.exists():  # a checkpoint of the same step from a run that was killed later: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_checkpoint(folder: str | os.PathLike, model, optimizer) -> dict[str, Any]:
    """Load model weights and optimizer state from `folder` into (possibly wrapped) `model`/`optimizer`.

    Returns:
        `dict`: the contents of `trainer_state.json` (step, scheduler state, …).
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    folder = Path(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    weights_file = folder / "trainable.safetensors"
    if not weights_file.exists():
        weights_file = folder / "model.safetensors"
    set_model_state_dict(model, load_file(weights_file), options=_options(strict=False))
    flat = load_file(folder / "optimizer.safetensors")
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, _, stat = key.rpartition("/")
        per_param.setdefault(name, {})[stat] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in state["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": per_param, "param_groups": groups}, options=_options())
    return state


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (temporary folders of interrupted saves are ignored)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def resolve_resume(spec: str | None, output_dir: str | os.PathLike) -> Path | None:
    """`None` → no resume; `"auto"` → newest checkpoint in `output_dir` (or none); otherwise that folder."""
    if spec is None:
        return None
    if spec == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(spec)
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(
            f"resume_from_checkpoint={spec!r} is not a complete checkpoint (no {STATE_FILE}); pass a "
            f"checkpoint-<step> folder or 'auto'. Complete ones in {output_dir}: "
            f"{[p.name for p in list_checkpoints(output_dir)]}"
        )
    return path


def prune_checkpoints(output_dir: str | os.PathLike, keep: int | None) -> None:
    """Delete all but the newest `keep` checkpoints (and leftovers of interrupted saves)."""
    root = Path(output_dir)
    for tmp in root.glob(".tmp-checkpoint-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep is None:
        return
    for old in list_checkpoints(root)[: max(0, len(list_checkpoints(root)) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
