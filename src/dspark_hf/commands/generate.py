"""`dspark generate`: speculative generation on a prompt, with τ and the speedup measured in the same run."""

from __future__ import annotations

import argparse
import statistics
import time

from ._common import UserError, model_source

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    parser.add_argument(
        "--target", default=None, help="target model folder or Hub id (default: SmolLM2-135M-Instruct, offline)"
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="shipped draft name, folder or Hub id (default: the shipped DSpark draft for the default target; "
        "'fresh' for an untrained one)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate per run (default: 96)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    parser.add_argument(
        "--policy",
        default=None,
        help=(
            "verification policy: fixed, fixed:N, adaptive[:N] (N drafts while that measurably pays), "
            "threshold:T (survival rule), confidence_threshold:T "
            "(DeepSpec's rule), hardware_aware[:BG], hardware_aware_lagged[:BG], "
            "hardware_aware_uniform[:BG] (default: the draft's recorded default_policy, else the library's; printed with "
            "the results)"
        ),
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repeats of each method; medians reported (default: 3)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default=None, help="where to run target and draft, e.g. cuda (default: cpu)")
    parser.add_argument(
        "--dtype", default=None, help="target (and draft) dtype: float32 (default), bfloat16 or float16"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for sampling and for a fresh draft's weights (default: 0)"
    )
    parser.add_argument(
        "--kernels",
        default=None,
        choices=("stock", "packed", "exact"),
        help="kernels the speculative run and its same-kernel plain baseline use: exact (batch-invariant: "
        "speculative greedy output equals plain decoding on them by construction), packed or stock "
        "(default: exact for float32 on a CPU, stock elsewhere; see docs/cpu-packing.md)",
    )
    parser.add_argument(
        "--refresh-sps",
        action="store_true",
        help="re-measure the target's SPS profile (the hardware-aware policies' cost curve) instead of reusing it",
    )


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from transformers import GenerationConfig

    from dspark_hf.default_model import SHIPPED_DRAFTS, chat_inputs, load_draft, load_target
    from dspark_hf.evaluation.harness import synchronize
    from dspark_hf.scheduling.policies import resolve_policy
    from dspark_hf.scheduling.sps import get_sps_profile

    if args.repeats < 1 or args.max_new_tokens < 1:
        raise UserError("--repeats and --max-new-tokens must be >= 1")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    # everything that can be checked before loading a model is checked first: a typo costs no load time
    model_source(args.target, "--target")
    model_source(args.draft, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))
    if args.policy is not None:
        try:
            resolve_policy(args.policy)  # syntax only; whether the draft can run it is checked once it is loaded
        except ValueError as err:
            raise UserError(f"--policy: {err}") from err
    if args.threads:
        torch.set_num_threads(args.threads)
    # the main job prints its reply and figures; transformers' per-file "Loading weights" bars are noise there
    transformers.utils.logging.disable_progress_bar()
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    draft, fresh = load_draft(target, args.draft, seed=args.seed)
    try:
        policy = resolve_policy(
            args.policy or draft.config.default_policy,
            has_confidence=draft.confidence_head is not None,
            calibrated=draft.config.confidence_calibrated,
        )
    except ValueError as err:
        raise UserError(f"--policy: {err}") from err
    if fresh:
        print(
            "note: no trained draft for this target (--draft), so this run uses a fresh, untrained draft: almost every drafted "
            "token is rejected, τ stays near 1 and there is no speedup. Output is still exactly the target's."
        )
    inputs = chat_inputs(tokenizer, args.prompt, target.device)
    sample = args.temperature > 0
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=sample,
        eos_token_id=target.generation_config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        dspark_policy=args.policy,
    )
    if sample:
        # plain sampling at the given temperature: top_k=0 / top_p=1.0 switch those filters off (left unset, a
        # GenerationConfig falls back to transformers' default top-k of 50). Greedy runs set neither, so
        # transformers does not warn that they are ignored.
        config.temperature, config.top_p, config.top_k = args.temperature, 1.0, 0

    from dspark_hf.model.kernels import recommended_kernels

    mode = args.kernels or recommended_kernels(target)
    if args.refresh_sps and policy.needs_sps:
        from dspark_hf.model.kernels import use_kernels

        with use_kernels(target, mode=mode):
            get_sps_profile(target, refresh=True)  # measured on the kernels the speculative run uses

    def timed(kernels, **extra):
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**inputs, generation_config=config, dspark_kernels=kernels, **extra)
        synchronize(out.device)  # a GPU runs asynchronously: count the work, not just its launch
        return out, time.perf_counter() - start

    # Three methods, interleaved so that all see the same machine load: plain decoding on stock kernels (what
    # a user of plain generate() gets), plain decoding on the speculative run's kernels (so the kernels' own
    # share of the speedup is separated from speculation's), and the speculative run.
    methods = {"plain": ("stock", {}), "spec": (mode, {"assistant_model": draft})}
    if mode != "stock":
        methods["plain_same"] = (mode, {})
    for kernels, extra in methods.values():  # warm-up (allocations, kernel build, SPS profile), not reported
        timed(kernels, **extra)
    times = {name: [] for name in methods}
    outs = {}
    for _ in range(args.repeats):
        for name, (kernels, extra) in methods.items():
            outs[name], elapsed = timed(kernels, **extra)
            times[name].append(elapsed)
    stats = draft.last_generation_stats
    prompt_len = inputs["input_ids"].shape[1]
    tps = {name: (outs[name].shape[1] - prompt_len) / statistics.median(times[name]) for name in methods}
    plain_out, spec_out = outs["plain"], outs["spec"]
    reply = tokenizer.decode(spec_out[0, prompt_len:], skip_special_tokens=True)
    plain_tps, spec_tps = tps["plain"], tps["spec"]
    print(f"\n{reply}\n")
    if args.policy is not None:
        chosen = "--policy"
    elif draft.config.default_policy:
        chosen = "the draft's recorded default, measured fastest for it on the evaluation"
    else:
        chosen = "the library default for this draft"
    print(f"policy: {policy.name} ({chosen}; {stats.policy})")
    if stats.lookup_rounds or draft.config.default_lookup or draft.lookup:
        print(f"prompt lookup: {stats.lookup_rounds} of {stats.num_rounds} rounds verified a copy from the context")
    else:
        print("prompt lookup: off (draft.lookup / the draft's default_lookup)")
    print(f"kernels: {mode} ({'--kernels' if args.kernels else 'the default'}; plain generate() below uses stock)")
    print(f"tau (tokens per target forward: accepted drafts + 1): {stats.tau:.2f} over {stats.num_rounds} rounds")
    print(f"plain generate(), stock kernels: {plain_tps:7.1f} tokens/s (median of {args.repeats})")
    if "plain_same" in tps:
        print(f"plain generate(), {mode} kernels: {tps['plain_same']:7.1f} tokens/s (the kernels speculation uses)")
    print(f"speculative (DSpark), {mode} kernels: {spec_tps:7.1f} tokens/s (median of {args.repeats})")
    print(f"speedup: {spec_tps / plain_tps:.2f}x over plain generate() on stock kernels (measured in this run)")
    if "plain_same" in tps:
        print(
            f"speculation alone (over plain decoding on the same {mode} kernels): {spec_tps / tps['plain_same']:.2f}x"
        )
    if not sample:
        same_kernels = outs.get("plain_same", plain_out)
        same = torch.equal(same_kernels, spec_out)
        promise = "; by construction with exact kernels" if mode == "exact" else ""
        print(
            f"greedy output identical to plain generate(): {'yes' if same else 'NO'} "
            f"(plain decoding on the same {mode} kernels{promise})"
        )
        if mode != "stock":
            stock_same = torch.equal(plain_out, spec_out)
            print(f"greedy output identical to plain generate() on stock kernels: {'yes' if stock_same else 'no'}")
        if not same:
            return 1
    return 0
