"""`dspark export`: write a draft in DeepSpec's format (vLLM / SGLang / TensorRT-LLM) or the speculators format."""

from __future__ import annotations

import argparse

from ._common import UserError, model_source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("draft", help="draft folder or Hub id")
    parser.add_argument("output", help="output folder")
    parser.add_argument("--target", default=None, help="target path or Hub id (default: the draft's recorded target)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--format",
        default="deepspec",
        choices=["deepspec", "speculators"],
        help="deepspec (default) or speculators (vLLM's speculators library; `vllm serve OUTPUT` loads it)",
    )


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_hf import DSparkDraftModel, export_deepspec, export_speculators

    model_source(args.draft, "draft")
    model_source(args.target, "--target")
    draft = DSparkDraftModel.from_pretrained(args.draft)
    target_id = args.target or draft.config.target_name_or_path
    if target_id is None:
        raise UserError("The draft records no target; pass --target (its embedding and LM head are exported too).")
    target = AutoModelForCausalLM.from_pretrained(target_id)
    export = export_speculators if args.format == "speculators" else export_deepspec
    export(draft, args.output, target=target, dtype=getattr(torch, args.dtype))
    print(f"wrote {'speculators' if args.format == 'speculators' else 'DeepSpec'}-format draft to {args.output}")
    return 0
