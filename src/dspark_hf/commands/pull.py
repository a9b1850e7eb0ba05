"""`dspark pull`: download a draft from the Hugging Face Hub (by branch, tag or commit), optionally converting it."""

from __future__ import annotations

import argparse
import os

from ._common import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="draft repo on the Hub (dspark-hf or DeepSpec format)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--local-dir", default=None, help="put the files in this folder (default: the HF cache only)")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--convert", action="store_true",
                        help="rewrite a DeepSpec-format draft in dspark-hf's format (needs --local-dir)")  # fmt: skip
    parser.add_argument("--target", default=None, help="also check that the draft fits this target (path or Hub id)")


def main(args: argparse.Namespace) -> int:
    from dspark_hf.model.hub import draft_format, pull_draft

    if args.convert and not args.local_dir:
        raise UserError("--convert needs --local-dir: the converted draft is written there, not into the HF cache.")
    path = pull_draft(args.repo_id, revision=args.revision, local_dir=args.local_dir, token=args.token)
    fmt = draft_format(path)
    if args.convert or args.target:
        from dspark_hf import DSparkDraftModel

        target = None
        if args.target:
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(args.target)
        draft = DSparkDraftModel.from_pretrained(path, target=target)  # checks compatibility when target is given
        if args.convert and fmt in ("deepspec", "speculators"):
            for name in os.listdir(
                path
            ):  # DeepSpec / speculators weights hold copies of the target's embedding and LM head
                if name.endswith((".safetensors", ".safetensors.index.json")):
                    os.remove(os.path.join(path, name))
            draft.save_pretrained(path)
            fmt = f"dspark (converted from {fmt})"
        if target is not None:
            print(f"compatible with target {args.target}")
    print(f"pulled {args.repo_id} (revision {args.revision or 'main'}, {fmt} format) to {path}")
    return 0
