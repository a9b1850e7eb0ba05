"""The `dspark` command line: one entry point, one module per subcommand (imported only when used)."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module under dspark_hf.commands exposing `add_arguments(parser)` and `main(args)`
COMMANDS = {
    "prepare-data": ("prepare_data", "Regenerate responses to prompts with the target; write token ids + loss mask."),
    "train": ("train", "Train a DSpark/DFlash draft or a LoRA adapter (accelerate; resumable)."),
    "generate": ("generate", "Speculative generation with a target and a DSpark draft; prints τ and the speedup."),
    "export": ("export", "Export a draft to DeepSpec's format (what vLLM / SGLang serve)."),
    "push": ("push", "Push a draft (config, safetensors weights, model card) to the Hugging Face Hub."),
    "pull": ("pull", "Download a draft from the Hugging Face Hub by branch, tag or commit."),
    "demo": ("demo", "Gradio app: chat with live token colouring by confidence, per-round chart and speedup."),
    "calibrate": (
        "calibrate",
        "Fit the confidence head's temperatures (STS) on held-out prompts; report ECE/AUROC/Brier.",
    ),
    "eval": (
        "eval",
        "Evaluate drafts on GSM8K/HumanEval/MT-Bench/ShareGPT: τ, acceptance by position, speedup, quality parity.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for Hugging Face models.")
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"dspark-hf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"dspark_hf.commands.{module}").add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .commands._common import UserError
    from .extras import MissingExtraError

    module = importlib.import_module(f"dspark_hf.commands.{COMMANDS[args.command][0]}")
    try:
        return module.main(args) or 0
    except (UserError, MissingExtraError) as err:  # a mistake on the command line or a missing extra: one line
        print(f"dspark {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
