"""`dspark train`: train a DSpark or DFlash draft (or a LoRA adapter on one) with `accelerate`.

Options are the fields of [`dspark_hf.train.ModelArguments`], `DataArguments`, `TrainArguments` and
`LoraArguments` (also settable in a YAML file given with `--config`). Multi-GPU:
`accelerate launch -m dspark_hf.cli train --config run.yaml`.
"""

from __future__ import annotations

import argparse

from ._common import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark_hf.train.args import TRAIN_ARGUMENT_TYPES, build_argument_parser

    build_argument_parser(TRAIN_ARGUMENT_TYPES, parser)


def main(args: argparse.Namespace) -> int:
    from dspark_hf.train.args import TRAIN_ARGUMENT_TYPES, args_from_namespace
    from dspark_hf.train.trainer import train

    model_args, data_args, train_args, lora_args = args_from_namespace(TRAIN_ARGUMENT_TYPES, args)
    if train_args.output_dir is None:
        raise UserError("dspark train needs --output_dir (where checkpoints, logs and the draft are written).")
    result = train(model_args, data_args, train_args, lora_args)
    if not result.is_main_process:  # under `accelerate launch`, report once
        return 0
    if result.eval_metrics is not None:
        m = result.eval_metrics
        accept = " ".join(f"{m[k]:.3f}" for k in m if k.startswith("accept@"))
        print(f"held-out: loss {m['loss']:.4f}  tau_est {m['tau_est']:.3f}  accept@k {accept}")
    what = "LoRA adapter" if lora_args.lora else "draft"
    print(f"wrote the {what} to {result.output_dir} after {result.global_step} steps")
    return 0
