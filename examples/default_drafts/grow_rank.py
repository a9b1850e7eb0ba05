"""Widen a DSpark draft's Markov head to a larger rank without changing what it drafts.

Round 7 (2026-12-05) asks whether the rank the shipped drafts traded for size (64, where DSpark's default is 256)
is what keeps the head's later positions near the first token's acceptance. A fresh head needs more than one
epoch to catch up with one trained over several rounds, so instead the trained rank-r head is widened to rank
R > r: `W1` (the transition embedding) gains R − r columns drawn as the draft's usual initialisation,
`W2` (the output projection) and the confidence head's weights on the new columns start at zero. The widened
draft therefore computes exactly the same logits and confidence as the original until training moves the new
weights; the script checks that on random tokens and states before it saves.

    python examples/default_drafts/grow_rank.py data/runs/round6-dspark data/runs/round6-dspark-r256 --rank 256

The backbone, the draft vocabulary and every other weight are copied unchanged; the calibration is kept
(the confidence it calibrated is unchanged).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

W1, W2, CONF = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"


def grow(src: Path, dst: Path, rank: int, seed: int = 0) -> None:
    config = json.loads((src / "config.json").read_text())
    if config.get("sequential_head") != "markov":
        raise SystemExit(f"{src}: grow_rank widens a Markov head; this draft has {config.get('sequential_head')!r}.")
    old = int(config["markov_rank"])
    if rank <= old:
        raise SystemExit(f"--rank must exceed the draft's rank {old}, got {rank}.")
    if dst.exists():
        raise SystemExit(f"{dst} exists; choose a new folder.")
    weights = load_file(src / "model.safetensors")
    extra = rank - old
    gen = torch.Generator().manual_seed(seed)
    w1 = weights[W1]
    new_cols = torch.randn(w1.shape[0], extra, generator=gen, dtype=w1.dtype) * float(config["initializer_range"])
    weights[W1] = torch.cat([w1, new_cols], dim=1).contiguous()
    w2 = weights[W2]
    weights[W2] = torch.cat([w2, w2.new_zeros(w2.shape[0], extra)], dim=1).contiguous()
    if CONF in weights and config.get("confidence_with_markov", False):
        conf = weights[CONF]  # [1, hidden + rank]: the Markov feature's columns come last
        weights[CONF] = torch.cat([conf, conf.new_zeros(1, extra)], dim=1).contiguous()
    config["markov_rank"] = rank
    dst.mkdir(parents=True)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("generation_config.json",):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    _check_same_function(src, dst)
    print(f"{src} (rank {old}) -> {dst} (rank {rank}): same logits and confidence, checked")


@torch.no_grad()
def _check_same_function(src: Path, dst: Path) -> None:
    from dspark_hf import DSparkDraftModel

    a, b = DSparkDraftModel.from_pretrained(src).eval(), DSparkDraftModel.from_pretrained(dst).eval()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.config.vocab_size, (64,), generator=gen)
    hidden = torch.randn(64, a.config.hidden_size, generator=gen)
    bias_a = a.markov_head.project(a.markov_head.embed(tokens))
    bias_b = b.markov_head.project(b.markov_head.embed(tokens))
    torch.testing.assert_close(bias_b, bias_a)
    if a.confidence_head is not None:
        conf_a = a.confidence_head(hidden, a.markov_head.embed(tokens) if a.confidence_head.with_markov else None)
        conf_b = b.confidence_head(hidden, b.markov_head.embed(tokens) if b.confidence_head.with_markov else None)
        torch.testing.assert_close(conf_b, conf_a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a DSpark draft folder with a Markov head")
    parser.add_argument("dst", type=Path, help="a new folder for the widened draft")
    parser.add_argument("--rank", type=int, default=256, help="the new rank (default 256, DSpark's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new W1 columns")
    args = parser.parse_args()
    grow(args.src, args.dst, args.rank, args.seed)


if __name__ == "__main__":
    main()
