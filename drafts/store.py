"""Store a trained draft folder as one of this package's drafts: configs copied, weights in float16.

    python drafts/store.py data/runs/dspark-round3-calibrated160 smollm2-135m-dspark

Floating-point tensors are written as float16 (integer buffers such as `draft_vocab_ids` as they are);
`config.json` keeps the draft's runtime dtype, so `from_pretrained` loads the weights upcast to it. The folder's
model card (`README.md`) is left as it is. Prints how many tensors float16 holds exactly and the largest
relative change of the rest: when that is not zero, measure τ before and after (the command is in
`drafts/README.md`). A tensor outside float16's range is refused.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PACKAGE = Path(__file__).resolve().parent / "dspark_hf_drafts"


def to_float16(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int, float]:
    """The tensors with every floating-point one in float16; how many of those are exact; the largest relative
    change (max |new - old| / max |old| per tensor)."""
    out, exact, worst = {}, 0, 0.0
    limit = torch.finfo(torch.float16).max
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            out[name] = tensor.contiguous()
            continue
        if tensor.abs().max().item() > limit:
            raise ValueError(f"{name}: values beyond float16's range ({limit}); keep this draft in float32")
        half = tensor.to(torch.float16).contiguous()
        change = (half.to(tensor.dtype) - tensor).abs().max().item()
        exact += change == 0.0
        worst = max(worst, change / max(tensor.abs().max().item(), 1e-30))
        out[name] = half
    return out, exact, worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a trained draft folder (config.json, model.safetensors)")
    parser.add_argument("name", help="the shipped draft's stable name (its folder under dspark_hf_drafts/)")
    args = parser.parse_args(argv)
    destination = PACKAGE / args.name
    destination.mkdir(exist_ok=True)
    for file in ("config.json", "generation_config.json"):
        if (args.source / file).is_file():
            shutil.copyfile(args.source / file, destination / file)
    tensors = load_file(args.source / "model.safetensors")
    half, exact, worst = to_float16(tensors)
    save_file(half, destination / "model.safetensors", metadata={"format": "pt"})
    floating = sum(t.is_floating_point() for t in tensors.values())
    size = (destination / "model.safetensors").stat().st_size
    print(
        f"{args.name}: {exact}/{floating} tensors exact in float16, largest relative change {worst:.2e}, {size:,} bytes"
    )


if __name__ == "__main__":
    main()
