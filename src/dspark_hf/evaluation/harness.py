"""Evaluate drafts against their target on named prompt sets (the paper's protocol, `docs/evaluation.md`).

[`evaluate_drafts`] runs plain `generate()`, speculative `generate(assistant_model=draft)` for every draft and,
at temperature 0, transformers' prompt lookup decoding, interleaved prompt by prompt, and returns an
[`EvalReport`][dspark_hf.evaluation.report.EvalReport]: τ, acceptance per position, verified length, tokens/s and
speedups measured in the same run, and the quality-parity checks. `dspark eval` is the command line for it.

The report, its statistics, Markdown and plots live beside this module (`report.py`, `statistics.py`,
`markdown.py`, `plots.py`); their public names are importable from here too. torch, tqdm, `evaluate` and
matplotlib are imported by the functions that use them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from .methods import PLAIN, PLAIN_EXACT, PLAIN_ON, PLAIN_PACKED, PROMPT_LOOKUP, TASK_METRICS
from .plots import MIN_CURVE_ROUNDS
from .prompt_sets import EVAL_SETS, PromptItem, load_prompt_set
from .report import EvalReport, PromptRun, quality_checks
from .statistics import acceptance_curves, paired_accuracy_test, ratio, rounds_of

__all__ = [
    "EVAL_SETS",
    "MIN_CURVE_ROUNDS",
    "PLAIN",
    "PLAIN_EXACT",
    "PLAIN_ON",
    "PLAIN_PACKED",
    "PROMPT_LOOKUP",
    "TASK_METRICS",
    "EvalReport",
    "PromptRun",
    "acceptance_curves",
    "evaluate_drafts",
    "paired_accuracy_test",
    "quality_checks",
    "rounds_of",
    "synchronize",
]


def synchronize(device) -> None:
    """Wait for queued GPU work on `device` (a no-op on the CPU), so wall-clock timings include it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generation_configs(target, tokenizer, temperature: float, max_new_tokens: int, lookup_tokens: int):
    from transformers import GenerationConfig

    sample = temperature > 0
    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # top_k=0 / top_p=1.0, not None: transformers fills None with its defaults (top-k 50), which would not be
    # the paper's plain temperature sampling.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    lookup = GenerationConfig(**config.to_diff_dict())
    lookup.prompt_lookup_num_tokens = lookup_tokens
    return config, lookup


def evaluate_drafts(
    target,
    tokenizer,
    drafts: Mapping,
    sets: Sequence[str] = EVAL_SETS,
    *,
    limit: int | None = None,
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 256,
    repeats: int = 1,
    policy: str | Mapping[str, str | None] | None = None,
    cuda_graphs: bool | Mapping[str, bool | None] | None = None,
    lookup: bool | Mapping[str, bool | None] | None = None,
    seed: int = 0,
    prompt_lookup: bool = True,
    prompt_lookup_num_tokens: int = 10,
    packed_baseline: bool | None = None,
    task_metrics: bool = True,
    prompts: Mapping[str, Sequence[PromptItem]] | None = None,
    progress: bool = True,
    kernels: str | None = None,
) -> EvalReport:
    """Evaluate `drafts` with `target` on prompt sets; plain and speculative runs interleaved per prompt.

    For every set × temperature × prompt, each repeat runs plain `generate()`, then each draft (and, at
    temperature 0 with `prompt_lookup`, prompt lookup decoding) with the same seed (`seed` + the prompt's
    index), so all methods see the same machine load and, at temperature 0, must produce the same tokens.

    Args:
        target (`PreTrainedModel`): the target model.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template (prompts are user turns).
        drafts (`Mapping[str, DSparkDraftModel]`): drafts bound to `target`, by the name used in the report.
        sets (`Sequence[str]`, *optional*, defaults to all of `EVAL_SETS`): prompt sets to load.
        limit (`int`, *optional*): first `limit` prompts of each set (default: all).
        temperatures (`Sequence[float]`, *optional*, defaults to `(0.0, 1.0)`): 0 is greedy; above 0 is plain
            sampling at that temperature (no top-k / top-p).
        max_new_tokens (`int`, *optional*, defaults to 256): per generation.
        repeats (`int`, *optional*, defaults to 1): timed repeats per method and prompt; medians are used.
        policy (`str` or `Mapping[str, str]`, *optional*): `dspark_policy` for every draft, or one per draft
            name. `None` (the default, also as a mapping's value) measures what users get: the draft runs with
            the policy `generate()` picks for it without a `dspark_policy` argument (the draft's own `policy`,
            its config's `default_policy`, else the product default, see [`resolve_policy`]); the policy each draft ran with is recorded in
            `report.methods[name]["policy"]`. `"fixed"` verifies the whole block, so τ is compared at full
            γ, as in the paper.
        cuda_graphs (`bool` or `Mapping[str, bool]`, *optional*): `dspark_cuda_graphs` for every draft, or one
            per draft name; `None` leaves `generate()`'s own choice (on for a CUDA draft). Whether the graph path
            ran is recorded in `report.methods[name]["cuda_graphs"]`.
        lookup (`bool` or `Mapping[str, bool]`, *optional*): `dspark_lookup` for every draft, or one per draft
            name (prompt lookup before drafting, `dspark_hf.decoding.lookup`); `None` leaves `generate()`'s default.
        seed (`int`, *optional*, defaults to 0): base seed.
        prompt_lookup (`bool`, *optional*, defaults to `True`): also time prompt lookup decoding at temperature 0.
        prompt_lookup_num_tokens (`int`, *optional*, defaults to 10): its `prompt_lookup_num_tokens`.
        packed_baseline (`bool`, *optional*): also time plain `generate()` with the target's linears packed
            (`"plain_packed"`, see `dspark_hf.model.cpu_packing`). Defaults to whether speculative decoding packs
            them here (on a CPU with packing enabled).
        kernels (`str`, *optional*): the kernel mode of the speculative and prompt-lookup runs (`"stock"`,
            `"packed"`, `"exact"`; see `dspark_hf.model.kernels`). Defaults to what `generate()` uses without a
            `dspark_kernels` argument. Plain `generate()` on the stock kernels (`"plain"`) is always timed;
            for another mode, plain `generate()` on that mode's kernels is timed too (`"plain_exact"` /
            `"plain_packed"`, with `speedup_vs_exact` / `speedup_vs_packed`), so the report separates what the
            kernels give from what speculation gives.
        task_metrics (`bool`, *optional*, defaults to `True`): score GSM8K / HumanEval replies.
        prompts (`Mapping[str, Sequence[PromptItem]]`, *optional*): use these prompts instead of loading `sets`.
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bars.

    Returns:
        [`EvalReport`]: with the quality checks filled in.
    """
    import torch
    from tqdm.auto import tqdm

    from ..default_model import chat_inputs
    from ..model.cpu_packing import cpu_packing_enabled
    from ..model.kernels import _check_mode, default_kernels

    reserved = {PLAIN, PROMPT_LOOKUP, *PLAIN_ON.values()} & set(drafts)
    if not drafts or reserved:
        raise ValueError(
            f"Got drafts named {sorted(drafts)}; pass at least one draft, and none named {PLAIN!r}, "
            f"{PLAIN_PACKED!r}, {PLAIN_EXACT!r} or {PROMPT_LOOKUP!r} (those names are the baselines)."
        )
    mode = _check_mode(kernels) if kernels is not None else default_kernels()
    if repeats < 1 or max_new_tokens < 1 or any(t < 0 for t in temperatures):
        raise ValueError(
            f"Got repeats={repeats}, max_new_tokens={max_new_tokens}, temperatures={list(temperatures)}; "
            "repeats and max_new_tokens must be >= 1 and temperatures >= 0."
        )
    items = dict(prompts) if prompts is not None else {s: load_prompt_set(s, limit) for s in sets}
    methods = {PLAIN: {"kind": "plain", "kernels": "stock"}}
    if mode != "stock":
        methods[PLAIN_ON[mode]] = {"kind": f"plain_{mode}", "kernels": mode}
    if packed_baseline is None:
        packed_baseline = mode == "packed" or (cpu_packing_enabled() and target.device.type == "cpu")
    if packed_baseline:
        methods[PLAIN_PACKED] = {"kind": "plain_packed", "kernels": "packed"}
    for name, draft in drafts.items():
        methods[name] = {
            "kind": "draft",
            "block_size": int(draft.config.block_size),
            "source": getattr(draft.config, "name_or_path", "") or "",
        }
    if prompt_lookup and 0 in temperatures:
        methods[PROMPT_LOOKUP] = {"kind": "prompt_lookup", "num_tokens": prompt_lookup_num_tokens}

    def run_once(inputs, method, configs, run_seed):
        config, lookup_config = configs
        kwargs = {"generation_config": lookup_config if method == PROMPT_LOOKUP else config}
        kwargs["dspark_kernels"] = methods[method].get("kernels", mode)  # drafts and prompt lookup: `mode`
        if method in drafts:
            kwargs["assistant_model"] = drafts[method]
            spec = policy.get(method) if isinstance(policy, Mapping) else policy
            if spec is not None:  # otherwise generate()'s own default, as a user gets it
                kwargs["dspark_policy"] = spec
            graphs = cuda_graphs.get(method) if isinstance(cuda_graphs, Mapping) else cuda_graphs
            if graphs is not None:
                kwargs["dspark_cuda_graphs"] = graphs
            look = lookup.get(method) if isinstance(lookup, Mapping) else lookup
            if look is not None:
                kwargs["dspark_lookup"] = look
        torch.manual_seed(run_seed)
        synchronize(target.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**inputs, **kwargs)
        synchronize(target.device)  # a GPU runs asynchronously: count the work, not just its launch
        seconds = time.perf_counter() - start
        rounds = rounds_of(drafts[method].last_generation_stats) if method in drafts else []
        return out[0, inputs["input_ids"].shape[1] :].tolist(), seconds, rounds

    # warm-up (first-call allocations and lazy initialisation), not reported
    first = next((rows[0] for rows in items.values() if rows), None)
    if first is not None:
        warm = chat_inputs(tokenizer, first.prompt, target.device)
        for temp in temperatures:
            configs = _generation_configs(target, tokenizer, temp, min(8, max_new_tokens), prompt_lookup_num_tokens)
            for method in methods:
                if method != PROMPT_LOOKUP or temp == 0:
                    run_once(warm, method, configs, seed)
                # the policy each method runs with, as its own warm-up run resolved it (read right after that
                # run: methods NAME@POLICY share one draft object, whose last stats are the last method's)
                stats = getattr(drafts.get(method), "last_generation_stats", None)
                if stats is not None and "policy" not in methods[method]:
                    methods[method]["policy"] = stats.policy
                    methods[method]["cuda_graphs"] = stats.cuda_graphs

    runs = []
    for set_name, rows in items.items():
        for temp in temperatures:
            configs = _generation_configs(target, tokenizer, temp, max_new_tokens, prompt_lookup_num_tokens)
            active = [m for m in methods if m != PROMPT_LOOKUP or temp == 0]
            bar = tqdm(rows, desc=f"{set_name} T={temp:g}", disable=not progress, leave=False)
            for index, item in enumerate(bar):
                inputs = chat_inputs(tokenizer, item.prompt, target.device)
                seconds = {m: [] for m in active}
                outputs = {}
                for _ in range(repeats):
                    for method in active:  # interleaved: every method sees the same machine load
                        ids, dt, rounds = run_once(inputs, method, configs, seed + index)
                        seconds[method].append(dt)
                        outputs[method] = (ids, rounds)
                for method in active:
                    ids, rounds = outputs[method]
                    reply = tokenizer.decode(ids, skip_special_tokens=True)
                    runs.append(PromptRun(set_name, item.id, float(temp), method, seconds[method], ids, reply, rounds))
                taus = {m: ratio(sum(a + 1 for _, a in outputs[m][1]), len(outputs[m][1])) for m in drafts}
                bar.set_postfix({f"τ {m}": f"{t:.2f}" for m, t in taus.items()})

    config = {
        "target": getattr(target.config, "name_or_path", ""),
        "target_dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "device": str(target.device),
        "sets": {s: len(rows) for s, rows in items.items()},
        "temperatures": [float(t) for t in temperatures],
        "sampling": "plain temperature sampling (top_k=0, top_p=1.0); greedy at temperature 0",
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "policy": dict(policy) if isinstance(policy, Mapping) else policy,
        "cuda_graphs": dict(cuda_graphs) if isinstance(cuda_graphs, Mapping) else cuda_graphs,
        "lookup": dict(lookup) if isinstance(lookup, Mapping) else lookup,
        "seed": seed,
        "torch_threads": torch.get_num_threads(),
        "kernels": mode,
        "timing": "per prompt, methods interleaved in every repeat; tokens/s = new tokens / median seconds, summed",
    }
    report = EvalReport(config, methods, runs)
    report.quality = quality_checks(report, items, task_metrics=task_metrics)
    return report
