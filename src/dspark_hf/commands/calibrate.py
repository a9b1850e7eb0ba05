"""`dspark calibrate`: fit Sequential Temperature Scaling on held-out prompts and save the calibrated draft."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._common import UserError, existing_file, model_source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", required=True, help="draft folder or Hub id")
    parser.add_argument("--prompts", required=True, help="JSONL of prompts (string, {'prompt'} or {'messages'})")
    parser.add_argument("--out", required=True, help="output folder: calibrated draft, report JSON, reliability PNG")
    parser.add_argument("--target", default=None, help="target path or Hub id (default: the draft's recorded target)")
    parser.add_argument("--max-prompts", type=int, default=None, help="use at most this many prompts")
    parser.add_argument(
        "--held-out-fraction", type=float, default=0.5, help="prompts kept out of the fit, for the report"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="decoding temperature (0 = greedy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-worse",
        action="store_true",
        help="save the fitted temperatures even if they make the held-out ECE worse than the raw confidences "
        "(default: keep temperatures of 1.0 then)",
    )


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_hf import DSparkDraftModel
    from dspark_hf.default_model import DEFAULT_TARGET_HUB_ID, load_default_target
    from dspark_hf.scheduling.calibration import calibrate, collect_records, json_safe, reliability_diagram
    from dspark_hf.train.data import load_prompt_rows, to_conversation

    if not 0.0 < args.held_out_fraction < 1.0:
        raise UserError(f"--held-out-fraction must be in (0, 1), got {args.held_out_fraction}")
    model_source(args.draft, "--draft")
    model_source(args.target, "--target")
    existing_file(args.prompts, "--prompts")
    draft = DSparkDraftModel.from_pretrained(args.draft)
    target_id = args.target or draft.config.target_name_or_path
    if target_id in (None, DEFAULT_TARGET_HUB_ID):
        target, tokenizer = load_default_target()
    else:
        target = AutoModelForCausalLM.from_pretrained(target_id).eval()
        tokenizer = AutoTokenizer.from_pretrained(target_id)
    draft = draft.to(target.dtype).eval()
    draft.bind_target(target)

    rows = load_prompt_rows(args.prompts)[: args.max_prompts]
    if len(rows) < 4:
        raise UserError(f"{args.prompts} has {len(rows)} prompt(s); calibration needs at least 4 (more is better).")
    inputs = [
        tokenizer.apply_chat_template(
            _first_turn(to_conversation(r)), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for r in rows
    ]
    cut = min(len(inputs) - 1, max(1, int(round(len(inputs) * (1 - args.held_out_fraction)))))
    torch.manual_seed(args.seed)
    sample = args.temperature > 0
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=sample,
        temperature=args.temperature if sample else 1.0,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    fit = collect_records(target, draft, inputs[:cut], **kwargs)
    held = collect_records(target, draft, inputs[cut:], **kwargs)
    report = calibrate(draft, fit, held, keep_worse=args.keep_worse)
    report.update(
        prompts=args.prompts, fit_prompts=cut, held_out_prompts=len(inputs) - cut, decoding_temperature=args.temperature
    )
    out = Path(args.out)
    draft.save_pretrained(out)
    (out / "calibration_report.json").write_text(json.dumps(json_safe(report), indent=2, allow_nan=False))
    # raw vs the fitted temperatures, also when the fit was rejected (the picture shows why)
    reliability_diagram(held, report.get("fitted_temperatures", report["temperatures"]), str(out / "reliability.png"))
    before, after = report["held_out"]["before"]["overall"], report["held_out"]["after"]["overall"]
    if report.get("kept") == "identity":
        print(
            f"the fitted temperatures {[round(t, 3) for t in report['fitted_temperatures']]} made the held-out ECE "
            "worse than the raw confidences: kept temperatures of 1.0 (--keep-worse saves the fit)"
        )
    print(f"temperatures: {[round(t, 3) for t in report['temperatures']]}")
    arrow = "-> the fit's (not kept)" if report.get("kept") == "identity" else "->"
    print(
        f"held-out ECE {100 * before['ece']:.2f}% {arrow} {100 * after['ece']:.2f}%, AUROC {after['auroc']:.3f}, "
        f"Brier {before['brier']:.4f} {arrow} {after['brier']:.4f} ({report['held_out']['rounds']} rounds)"
    )
    print(f"wrote {out} (calibrated draft, calibration_report.json, reliability.png)")
    return 0


def _first_turn(messages: list[dict]) -> list[dict]:
    """System message(s) and the first user message: calibration follows the paper's first-turn protocol."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first_user + 1]
