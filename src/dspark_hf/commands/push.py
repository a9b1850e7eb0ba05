"""`dspark push`: upload a draft (config, safetensors weights, generated model card) to the Hugging Face Hub."""

from __future__ import annotations

import argparse
import json

from ._common import UserError, model_source

DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("draft", help="draft folder or Hub id (dspark-hf or DeepSpec format)")
    parser.add_argument("repo_id", help="destination repo, e.g. your-name/dspark-qwen3-4b (created if missing)")
    parser.add_argument("--format", default="dspark", choices=["dspark", "deepspec"],
                        help="dspark: dspark-hf's format (loads with AutoModel); deepspec: for vLLM / SGLang")  # fmt: skip
    parser.add_argument("--target", default=None,
                        help="target path or Hub id; needed for --format deepspec (default: the draft's recorded "
                        "target). With --format dspark it is only used to check compatibility.")  # fmt: skip
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="weights dtype for --format deepspec")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing; default: main)")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument("--eval-results", default=None, metavar="JSON",
                        help='evaluation results for the model card: {"benchmark": {"metric": value}} or a list of rows')  # fmt: skip
    parser.add_argument("--training-config", default=None, metavar="FILE",
                        help="training configuration (JSON or YAML) shown in the model card")  # fmt: skip
    parser.add_argument("--license", default="apache-2.0", help="license id of the weights (default: apache-2.0)")
    parser.add_argument("--tag", dest="tags", action="append", default=None, help="extra model-card tag (repeatable)")


def _read_data_file(path: str, what: str):
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"Could not read {what} from {path!r}: {e}. Give a JSON (.json) or YAML file.") from e


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_hf import DSparkDraftModel
    from dspark_hf.model.hub import push_draft

    model_source(args.draft, "draft")
    model_source(args.target, "--target")
    draft = DSparkDraftModel.from_pretrained(args.draft)
    target = None
    target_id = args.target or (draft.config.target_name_or_path if args.format == "deepspec" else None)
    if args.format == "deepspec" and target_id is None:
        raise UserError(
            "--format deepspec stores the target's embedding and LM head, but the draft records no target. "
            "Pass --target PATH_OR_HUB_ID (the causal LM the draft was built for)."
        )
    if target_id is not None:
        target = AutoModelForCausalLM.from_pretrained(target_id)
        draft.bind_target(target)  # checks compatibility before anything is uploaded
    card_kwargs = {"license": args.license, "tags": args.tags}
    if args.eval_results:
        card_kwargs["evaluation"] = _read_data_file(args.eval_results, "evaluation results")
    if args.training_config:
        card_kwargs["training_config"] = _read_data_file(args.training_config, "the training configuration")
    info = push_draft(
        draft,
        args.repo_id,
        format=args.format,
        target=target,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        revision=args.revision,
        private=args.private or None,
        token=args.token,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        **card_kwargs,
    )
    print(f"pushed {args.draft} to {args.repo_id} ({args.format} format), commit {info.oid}")
    print(info.pr_url or info.commit_url)
    return 0
