"""Checks and copies made while a draft's weights load: safetensors only, and a loaded draft bit-identical to the
saved one (`DSparkDraftModel.from_pretrained` and the DeepSpec / speculators loaders)."""

from __future__ import annotations

import os

import torch
from torch import nn


def own_aligned_storage(model: nn.Module) -> None:
    """Give every parameter its own, freshly allocated storage.

    Tensors loaded from safetensors can live at an unaligned offset of a memory-mapped file; CPU math
    libraries then take a different code path and the last bit of a result may differ from the model
    that was saved. Copying makes a loaded draft bit-identical to the saved one.
    """
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.data = tensor.data.clone()


def refuse_pickle(path: str) -> None:
    """Refuse a folder that holds pickle checkpoints and no safetensors (unpickling can run arbitrary code)."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        has_safe = any(n.endswith(".safetensors") for n in names)
        pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")))
        if pickles and not has_safe:
            raise ValueError(
                f"{path} holds only pickle checkpoint(s) {pickles}; dspark_hf loads safetensors only, because "
                "unpickling can run arbitrary code. Convert it once in a trusted environment, e.g. "
                "`model.save_pretrained(out_dir, safe_serialization=True)`."
            )


def load_exact_weights(draft: nn.Module, weights: dict, source: str, fmt: str) -> None:
    """Load `weights` (a converted `fmt` checkpoint read from `source`) into `draft`; every key and shape must
    match the draft its config describes, else a `ValueError` lists the differences."""
    expected = draft.state_dict()
    wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in weights.items() if k in expected}
    wrong = {k: shapes for k, shapes in wrong.items() if shapes[0] != shapes[1]}
    if wrong:
        raise ValueError(
            f"{fmt} checkpoint {source} does not match the draft its config describes: (stored, expected) shapes "
            f"{wrong}."
        )
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{fmt} checkpoint {source} does not match the draft architecture: missing {missing}, "
            f"unexpected {unexpected}."
        )
