"""`dspark eval`: τ, acceptance by position, speedup and quality parity of drafts on named prompt sets."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..evaluation.prompt_sets import EVAL_SETS
from ._common import UserError, model_source
from .arguments import SpeculationArguments, add_model_arguments, add_speculation_arguments, speculation_variants


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        action="append",
        metavar="NAME=PATH",
        default=None,
        help="a draft to evaluate, repeatable: NAME=PATH, or just PATH (named after its folder); PATH is a shipped "
        "draft's name, a folder, a Hub id or 'fresh' (default: the shipped DSpark draft of the default target)",
    )
    parser.add_argument("--sets", nargs="+", default=list(EVAL_SETS), choices=EVAL_SETS, help="prompt sets")
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="evaluate the prompts of this JSONL file instead of --sets: one object per line with 'prompt', and "
        "optionally 'set', 'id' and 'reference' (task metrics score sets named gsm8k / humaneval)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set (default: all)")
    parser.add_argument(
        "--temperatures", nargs="+", type=float, default=[0.0, 1.0], help="0 = greedy; >0 = plain sampling"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per prompt and method; medians used")
    parser.add_argument("--seed", type=int, default=0, help="base seed; prompt i is seeded seed+i for every method")
    parser.add_argument(
        "--prompt-lookup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time transformers' prompt lookup decoding at temperature 0 (a draft-free baseline)",
    )
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument(
        "--packed-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time plain generate() on packed CPU linears, the kernels speculation then uses "
        "(default: when --kernels packed)",
    )
    parser.add_argument(
        "--task-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score GSM8K answers and HumanEval pass@1 with and without speculation",
    )
    parser.add_argument(
        "--output", default="dspark-eval", help="folder for results.json, results.md and plots (default: ./dspark-eval)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_arguments(parser)
    add_speculation_arguments(parser, several=True)


def parse_draft_specs(specs: list[str] | None) -> list[tuple[str, str | None]]:
    """`NAME=PATH` or `PATH` entries → `(name, path)`; no entry → the default draft, named `dspark`."""
    if not specs:
        return [("dspark", None)]
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name or spec, spec
        if not name or not path:
            raise UserError(f"--draft {spec!r}: expected NAME=PATH (e.g. dspark=./my-draft) or a PATH.")
        if name in {n for n, _ in out}:
            raise UserError(f"--draft: the name {name!r} is used twice; name each draft differently (NAME=PATH).")
        out.append((name, path))
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation.harness import evaluate_drafts
    from ..evaluation.prompt_sets import load_prompt_file

    specs, variants = _check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, drafts, fresh = _load(args, specs)
    methods = {  # one method per draft and variant of the speculation flags; a draft object serves all of its own
        "@".join(filter(None, (name, suffix))): (name, variant)
        for name in drafts
        for suffix, variant in variants.items()
    }
    report = evaluate_drafts(
        target,
        tokenizer,
        {method: drafts[name] for method, (name, _) in methods.items()},
        args.sets,
        prompts=load_prompt_file(args.prompts, args.limit) if args.prompts else None,
        limit=args.limit,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        seed=args.seed,
        prompt_lookup=args.prompt_lookup,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        packed_baseline=args.packed_baseline,
        kernels=args.kernels,
        task_metrics=args.task_metrics,
        progress=not args.no_progress,
        **_per_draft_options(methods),
    )
    for method, (name, _) in methods.items():
        report.methods[method].update(source=dict(specs)[name] or "default draft", fresh=name in fresh)
    files = report.save(args.output)
    print(report.to_markdown())
    print("wrote " + ", ".join(str(f) for f in files))
    return _greedy_identity(report)


def _check_arguments(args: argparse.Namespace) -> tuple[list, dict[str, SpeculationArguments]]:
    """Every check that needs no model, so a mistake costs no load time: the draft specs and the speculation
    flags' variants."""
    from ..default_model import SHIPPED_DRAFTS

    if args.repeats < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--repeats, --max-new-tokens and --limit must be >= 1")
    specs = parse_draft_specs(args.draft)
    model_source(args.target, "--target")
    for _, path in specs:
        model_source(path, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))
    variants = speculation_variants(args)
    for variant in variants.values():
        variant.check()
    return specs, variants


def _load(args: argparse.Namespace, specs: list) -> tuple:
    """The target, its tokenizer, the drafts by name, and the names of the fresh (untrained) ones."""
    from ..default_model import load_draft, load_target

    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    drafts, fresh = {}, []
    for name, path in specs:
        drafts[name], is_fresh = load_draft(target, path, seed=args.seed)
        if is_fresh:
            fresh.append(name)
    if fresh:
        print(
            f"note: {', '.join(fresh)} is a fresh, untrained draft (no trained draft for this target, or 'fresh' "
            "asked for): almost every drafted token is rejected, so τ stays near 1. Outputs are still exact."
        )
    return target, tokenizer, drafts, fresh


def _per_draft_options(methods: dict) -> dict:
    """`evaluate_drafts`' per-draft options (the call level of each draft's options; `None`: the draft's own
    default): one value for every draft when no flag varies, else one per method."""
    calls = {method: variant.call() for method, (_, variant) in methods.items()}
    names = ("policy", "cuda_graphs", "lookup", "compiled")
    if len(calls) == len({name for name, _ in methods.values()}):  # one variant: the same values for every draft
        return {name: next(iter(calls.values()))[name] for name in names}
    return {name: {method: call[name] for method, call in calls.items()} for name in names}


def _greedy_identity(report) -> int:
    """Print where greedy output differs from plain `generate()`; 1 if it differs on the same kernels (a bug)."""

    def mismatched(key: str) -> list[str]:
        return [
            f"{method} on {set_name} ({', '.join(v['mismatched'])})"
            for set_name, cell in report.quality.get(key, {}).items()
            for method, v in cell.items()
            if v["mismatched"]
        ]

    kernels = report.config["kernels"]
    if kernels != "stock" and mismatched("greedy_identity"):  # a near-tie decided by the kernels: reported
        print(
            "note: greedy output differs from plain generate() on the stock kernels (a near-tie of two logits "
            f"that the {kernels} kernels round the other way): " + "; ".join(mismatched("greedy_identity"))
        )
    same = mismatched("greedy_identity_same_kernels")
    if same:  # speculation changed the output: a bug
        print(f"greedy output differs from plain generate() on the same ({kernels}) kernels: " + "; ".join(same))
        return 1
    return 0
