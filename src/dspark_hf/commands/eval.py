"""`dspark eval`: τ, acceptance by position, speedup and quality parity of drafts on named prompt sets."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from ..evaluation.prompt_sets import EVAL_SETS
from ._common import UserError, model_source

GRAPH_MODES = {"auto": None, "on": True, "off": False}  # --cuda-graphs → generate(dspark_cuda_graphs=...)
LOOKUP_MODES = {"default": None, "on": True, "off": False}  # --lookup → generate(dspark_lookup=...)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model path or Hub id (default: SmolLM2-135M-Instruct)")
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
    parser.add_argument(
        "--policy",
        nargs="+",
        default=None,
        help=(
            "dspark_policy for every draft (default: none given, so each draft runs with the policy generate() "
            "uses by default, which is what users get; 'fixed' verifies the whole block, so τ compares at full γ). "
            "Several policies run each draft under each, as methods NAME@POLICY, e.g. --policy default fixed, or "
            "--policy threshold:0.7 confidence_threshold:0.7 (the survival rule and DeepSpec's rule); 'default' "
            "names generate()'s own choice"
        ),
    )
    parser.add_argument(
        "--cuda-graphs",
        nargs="+",
        choices=sorted(GRAPH_MODES),
        default=None,
        help="dspark_cuda_graphs for every draft: auto (the default: on for CUDA), on or off. Several values run "
        "each draft under each, as methods NAME@graphs-MODE, side by side (e.g. --cuda-graphs on off)",
    )
    parser.add_argument(
        "--lookup",
        nargs="+",
        choices=sorted(LOOKUP_MODES),
        default=None,
        help="dspark_lookup for every draft: default (what generate() does by default), on (prompt lookup proposes "
        "before the draft drafts, see dspark_hf.decoding.lookup) or off. Several values run each draft under each, "
        "as methods NAME@lookup-MODE, side by side (e.g. --lookup on off)",
    )
    parser.add_argument("--seed", type=int, default=0, help="base seed; prompt i is seeded seed+i for every method")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default=None, help="where to run target and drafts, e.g. cuda (default: cpu)")
    parser.add_argument(
        "--dtype", default=None, help="target (and draft) dtype: float32 (default), bfloat16 or float16"
    )
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
        "(default: when packing is enabled, DSPARK_CPU_PACKING=1)",
    )
    parser.add_argument(
        "--kernels",
        choices=("stock", "packed", "exact"),
        default=None,
        help="kernels of the speculative and prompt-lookup runs; plain generate() is timed on the stock kernels "
        "and on these (default: exact for a float32 target on a CPU, as dspark generate and dspark serve; "
        "stock elsewhere)",
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

    from ..default_model import SHIPPED_DRAFTS, load_draft, load_target
    from ..evaluation.harness import evaluate_drafts
    from ..evaluation.prompt_sets import load_prompt_file
    from ..model.kernels import recommended_kernels

    if args.repeats < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--repeats, --max-new-tokens and --limit must be >= 1")
    specs = parse_draft_specs(args.draft)
    model_source(args.target, "--target")
    for _, path in specs:
        model_source(path, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))
    if args.threads:
        torch.set_num_threads(args.threads)
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
    specs_given = args.policy or ["default"]
    graphs_given = args.cuda_graphs or ["auto"]
    policy = None if specs_given[0] == "default" else specs_given[0]
    cuda_graphs = GRAPH_MODES[graphs_given[0]]
    lookups_given = args.lookup or ["default"]
    lookup = LOOKUP_MODES[lookups_given[0]]
    if len(specs_given) > 1 or len(graphs_given) > 1 or len(lookups_given) > 1:
        # one method per (draft, policy, graph mode); the same draft object serves all of them
        from ..scheduling.policies import resolve_policy

        for spec in specs_given:  # fail before loading any prompt
            if spec != "default":
                resolve_policy(spec, has_confidence=True)
        axes = (specs_given, graphs_given, lookups_given)
        labels = ("{}", "graphs-{}", "lookup-{}")  # a variant's part of NAME@..., for the axes that vary
        named = {}
        for name, *variant in itertools.product(drafts, *axes):
            parts = [label.format(v) for v, label, axis in zip(variant, labels, axes) if len(axis) > 1]
            named["@".join([name, *parts])] = (name, *variant)
        drafts = {method: drafts[name] for method, (name, *_) in named.items()}
        policy = {method: None if spec == "default" else spec for method, (_, spec, _, _) in named.items()}
        cuda_graphs = {method: GRAPH_MODES[mode] for method, (_, _, mode, _) in named.items()}
        lookup = {method: LOOKUP_MODES[look] for method, (*_, look) in named.items()}
        specs = [(method, dict(specs)[name]) for method, (name, *_) in named.items()]
        fresh = [method for method, (name, *_) in named.items() if name in fresh]
    prompts = load_prompt_file(args.prompts, args.limit) if args.prompts else None
    report = evaluate_drafts(
        target,
        tokenizer,
        drafts,
        args.sets,
        prompts=prompts,
        limit=args.limit,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        policy=policy,
        cuda_graphs=cuda_graphs,
        lookup=lookup,
        seed=args.seed,
        prompt_lookup=args.prompt_lookup,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        packed_baseline=args.packed_baseline,
        kernels=args.kernels or recommended_kernels(target),
        task_metrics=args.task_metrics,
        progress=not args.no_progress,
    )
    for name, path in specs:
        report.methods[name].update(source=path or "default draft", fresh=name in fresh)
    files = report.save(args.output)
    print(report.to_markdown())
    print("wrote " + ", ".join(str(f) for f in files))

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
