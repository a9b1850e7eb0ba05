"""`dspark generate`: speculative generation on a prompt, with τ and the speedup measured in the same run."""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from ..model.runs import last_generation_stats
from ._common import UserError, model_source
from .arguments import SpeculationArguments, add_model_arguments, add_speculation_arguments

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    parser.add_argument(
        "--draft",
        default=None,
        help="shipped draft name, folder or Hub id (default: the shipped DSpark draft for the default target; "
        "'fresh' for an untrained one)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate per run (default: 96)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repeats of each method; medians reported (default: 3)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for sampling and for a fresh draft's weights (default: 0)"
    )
    parser.add_argument(
        "--refresh-sps",
        action="store_true",
        help="re-measure the target's SPS profile (the hardware-aware policies' cost curve) instead of reusing it",
    )
    add_model_arguments(parser)
    add_speculation_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from dspark_hf.default_model import chat_inputs, load_draft, load_target

    speculation = _check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    # the main job prints its reply and figures; transformers' per-file "Loading weights" bars are noise there
    transformers.utils.logging.disable_progress_bar()
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    draft, fresh = load_draft(target, args.draft, seed=args.seed)
    options = speculation.resolve(draft, target)  # once: what the run prints; each generate() call resolves its own
    if fresh:
        print(
            "note: no trained draft for this target (--draft), so this run uses a fresh, untrained draft: almost every drafted "
            "token is rejected, τ stays near 1 and there is no speedup. Output is still exactly the target's."
        )
    if args.refresh_sps and options.policy.needs_sps:
        from dspark_hf.kernels import use_kernels
        from dspark_hf.scheduling.sps import get_sps_profile

        with use_kernels(target, mode=options.kernels):
            get_sps_profile(target, refresh=True)  # measured on the kernels the speculative run uses
    inputs = chat_inputs(tokenizer, args.prompt, target.device)
    configs = _method_configs(args, target, tokenizer, speculation, options.kernels)
    outs, times = _timed_methods(args, target, draft, inputs, configs)
    stats = last_generation_stats(draft)
    prompt_len = inputs["input_ids"].shape[1]
    tps = {name: (outs[name].shape[1] - prompt_len) / statistics.median(times[name]) for name in outs}
    print(f"\n{tokenizer.decode(outs['spec'][0, prompt_len:], skip_special_tokens=True)}\n")
    _print_options(args, draft, options, stats)
    _print_speeds(args, options.kernels, tps)
    return _print_identity(args, options.kernels, outs)


def _check_arguments(args: argparse.Namespace) -> SpeculationArguments:
    """Everything that can be checked before a model loads, so a typo costs no load time."""
    from dspark_hf.default_model import SHIPPED_DRAFTS

    if args.repeats < 1 or args.max_new_tokens < 1:
        raise UserError("--repeats and --max-new-tokens must be >= 1")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    model_source(args.target, "--target")
    model_source(args.draft, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))
    speculation = SpeculationArguments.from_namespace(args)
    speculation.check()  # the policy's spelling; whether the draft can run it is known once it is loaded
    return speculation


def _method_configs(args, target, tokenizer, speculation: SpeculationArguments, kernels: str) -> dict:
    """The `GenerationConfig` of each method, its options as `dspark_*` attributes (the call level).

    Three methods, timed interleaved so that all see the same machine load: plain decoding on stock kernels (what a
    user of plain generate() gets), plain decoding on the speculative run's kernels (so the kernels' own share of
    the speedup is separated from speculation's; left out when those are stock too), and the speculative run.
    """
    from transformers import GenerationConfig

    from dspark_hf.decoding.options import config_key

    sample = args.temperature > 0
    base = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=sample,
        eos_token_id=target.generation_config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    if sample:
        # plain sampling at the given temperature: top_k=0 / top_p=1.0 switch those filters off (left unset, a
        # GenerationConfig falls back to transformers' default top-k of 50). Greedy runs set neither, so
        # transformers does not warn that they are ignored.
        base.temperature, base.top_p, base.top_k = args.temperature, 1.0, 0
    configs = {"plain": "stock", "plain_same": kernels, "spec": kernels}
    if kernels == "stock":
        del configs["plain_same"]
    for name, mode in configs.items():
        configs[name] = copy.deepcopy(base)
        configs[name].dspark_kernels = mode
    for name, value in speculation.call().items():  # the speculative run's options, at the call level
        if value is not None and name != "kernels":
            setattr(configs["spec"], config_key(name), value)
    return configs


def _timed_methods(args, target, draft, inputs: dict, configs: dict) -> tuple[dict, dict]:
    """Each method's output and its `--repeats` timings (after one untimed warm-up run each)."""
    import torch

    from dspark_hf.evaluation.harness import synchronize

    def timed(name):
        extra = {"assistant_model": draft} if name == "spec" else {}
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**inputs, generation_config=configs[name], **extra)
        synchronize(out.device)  # a GPU runs asynchronously: count the work, not just its launch
        return out, time.perf_counter() - start

    for name in configs:  # warm-up (allocations, kernel build, SPS profile), not reported
        timed(name)
    outs, times = {}, {name: [] for name in configs}
    for _ in range(args.repeats):
        for name in configs:
            outs[name], elapsed = timed(name)
            times[name].append(elapsed)
    return outs, times


def _print_options(args, draft, options, stats) -> None:
    """Which policy, prompt lookup setting and kernels the run used, and where each came from."""
    from dspark_hf.decoding.options import draft_defaults

    defaults = draft_defaults(draft)
    if args.policy not in (None, "default"):
        chosen = "--policy"
    elif getattr(defaults, "dspark_policy", None):
        chosen = "the draft's recorded default (its generation_config.json)"
    else:
        chosen = "the library default for this draft"
    print(f"policy: {options.policy.name} ({chosen}; {stats.policy})")
    if stats.lookup_rounds or options.lookup is not None:
        print(f"prompt lookup: {stats.lookup_rounds} of {stats.num_rounds} rounds verified a copy from the context")
    else:
        print("prompt lookup: off (--lookup / the draft's default)")
    print(
        f"kernels: {options.kernels} ({'--kernels' if args.kernels else 'the default'}; plain generate() below uses stock)"
    )
    print(f"tau (tokens per target forward: accepted drafts + 1): {stats.tau:.2f} over {stats.num_rounds} rounds")


def _print_speeds(args, mode: str, tps: dict) -> None:
    """Tokens/s of each method and the speedups, all measured in this run."""
    plain_tps, spec_tps = tps["plain"], tps["spec"]
    print(f"plain generate(), stock kernels: {plain_tps:7.1f} tokens/s (median of {args.repeats})")
    if "plain_same" in tps:
        print(f"plain generate(), {mode} kernels: {tps['plain_same']:7.1f} tokens/s (the kernels speculation uses)")
    print(f"speculative (DSpark), {mode} kernels: {spec_tps:7.1f} tokens/s (median of {args.repeats})")
    print(f"speedup: {spec_tps / plain_tps:.2f}x over plain generate() on stock kernels (measured in this run)")
    if "plain_same" in tps:
        print(
            f"speculation alone (over plain decoding on the same {mode} kernels): {spec_tps / tps['plain_same']:.2f}x"
        )


def _print_identity(args, mode: str, outs: dict) -> int:
    """Greedily, whether the speculative output equals plain decoding's; 1 if it differs on the same kernels."""
    import torch

    if args.temperature > 0:
        return 0
    same = torch.equal(outs.get("plain_same", outs["plain"]), outs["spec"])
    promise = "; by construction with exact kernels" if mode in ("exact", "exact-bf16") else ""
    print(
        f"greedy output identical to plain generate(): {'yes' if same else 'NO'} "
        f"(plain decoding on the same {mode} kernels{promise})"
    )
    if mode != "stock":
        stock_same = torch.equal(outs["plain"], outs["spec"])
        print(f"greedy output identical to plain generate() on stock kernels: {'yes' if stock_same else 'no'}")
    return 0 if same else 1
