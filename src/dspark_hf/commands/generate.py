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
            "verification policy: fixed, fixed:N, threshold:T (survival rule), confidence_threshold:T "
            "(DeepSpec's rule), hardware_aware[:BG], hardware_aware_lagged[:BG], "
            "hardware_aware_uniform[:BG] (default: the draft's default; printed with the results)"
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


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from transformers import GenerationConfig

    from dspark_hf.default_model import SHIPPED_DRAFTS, chat_inputs, load_draft, load_target
    from dspark_hf.evaluation.harness import synchronize
    from dspark_hf.model.cpu_packing import cpu_packing_enabled, packed_linears
    from dspark_hf.scheduling.policies import resolve_policy

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
            args.policy,
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

    def timed(packed=False, **extra):
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        with torch.no_grad(), packed_linears(target, enabled=packed):
            out = target.generate(**inputs, generation_config=config, **extra)
        synchronize(out.device)  # a GPU runs asynchronously: count the work, not just its launch
        return out, time.perf_counter() - start

    # On a CPU speculative decoding runs the linears on packed weights (dspark_hf.model.cpu_packing); plain decoding
    # on the same kernels is timed too, so the printout separates the kernels' share from speculation's.
    packing = cpu_packing_enabled() and target.device.type == "cpu"
    timed(), timed(assistant_model=draft)  # warm-up (allocations, weight packing, SPS profile), not reported
    plain_times, packed_times, spec_times = [], [], []
    for _ in range(args.repeats):  # interleaved, so all methods see the same machine load
        plain_out, t_plain = timed()
        spec_out, t_spec = timed(assistant_model=draft)
        plain_times.append(t_plain)
        spec_times.append(t_spec)
        if packing:
            packed_times.append(timed(packed=True)[1])
    stats = draft.last_generation_stats
    new_plain = plain_out.shape[1] - inputs["input_ids"].shape[1]
    new_spec = spec_out.shape[1] - inputs["input_ids"].shape[1]
    reply = tokenizer.decode(spec_out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    plain_tps = new_plain / statistics.median(plain_times)
    spec_tps = new_spec / statistics.median(spec_times)
    print(f"\n{reply}\n")
    chosen = "the default for this draft" if args.policy is None else "--policy"
    print(f"policy: {policy.name} ({chosen}; {stats.policy})")
    print(f"tau (tokens per target forward: accepted drafts + 1): {stats.tau:.2f} over {stats.num_rounds} rounds")
    print(f"plain generate():       {plain_tps:7.1f} tokens/s (median of {args.repeats})")
    if packing:
        packed_tps = new_plain / statistics.median(packed_times)
        print(f"plain, packed linears:  {packed_tps:7.1f} tokens/s (the CPU kernels speculation uses)")
    print(f"speculative (DSpark):   {spec_tps:7.1f} tokens/s (median of {args.repeats})")
    print(f"speedup: {spec_tps / plain_tps:.2f}x (measured in this run)")
    if packing:
        print(f"speculation alone (over plain decoding on the same packed kernels): {spec_tps / packed_tps:.2f}x")
    if not sample:
        same = torch.equal(plain_out, spec_out)
        print(f"greedy output identical to plain generate(): {'yes' if same else 'NO'}")
        if not same:
            return 1
    return 0
