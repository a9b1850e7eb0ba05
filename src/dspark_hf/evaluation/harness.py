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

import copy
import time
from collections.abc import Mapping, Sequence

from ..model.runs import last_generation_stats
from .methods import PLAIN, PLAIN_EXACT, PLAIN_EXACT_BF16, PLAIN_ON, PLAIN_PACKED, PROMPT_LOOKUP, TASK_METRICS
from .plots import MIN_CURVE_ROUNDS
from .prompt_sets import EVAL_SETS, PromptItem, load_prompt_set
from .report import EvalReport, PromptRun, quality_checks
from .statistics import acceptance_curves, paired_accuracy_test, ratio, rounds_of

__all__ = [
    "EVAL_SETS",
    "MIN_CURVE_ROUNDS",
    "PLAIN",
    "PLAIN_EXACT",
    "PLAIN_EXACT_BF16",
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
    compiled: bool | Mapping[str, bool | None] | None = None,
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
    Each draft's options are resolved once ([`resolve_options`][dspark_hf.decoding.options.resolve_options]) and
    ride on its calls' `GenerationConfig`.

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
        policy, cuda_graphs, lookup, compiled (*optional*): `dspark_policy`, `dspark_cuda_graphs`, ... for every
            draft, or a mapping with one per draft name. `None` (also as a mapping's value) measures what users get:
            the draft's own default, else the library's. `report.methods[name]` records the policy each draft ran
            with and whether its graph path ran; `policy="fixed"` verifies the whole block (τ at full γ). `seed`
            (defaults to 0) is the base seed.
        prompt_lookup, prompt_lookup_num_tokens (*optional*): also time prompt lookup decoding at T = 0 (`True`, 10).
        packed_baseline (`bool`, *optional*): also time plain `generate()` on packed linears (`"plain_packed"`).
            Defaults to `kernels == "packed"`.
        kernels (`str`, *optional*): the kernel mode of the speculative and prompt-lookup runs (`"stock"`,
            `"packed"`, `"exact"`); defaults to the library's default for `target`. Plain `generate()` is timed on
            the stock kernels (`"plain"`) and, for another mode, on that mode's too (`"plain_exact"` /
            `"plain_packed"`, with `speedup_vs_exact` / `speedup_vs_packed`): what speculation itself adds.
        task_metrics (`bool`, *optional*, defaults to `True`): score GSM8K / HumanEval replies.
        prompts (`Mapping[str, Sequence[PromptItem]]`, *optional*): use these prompts instead of loading `sets`.
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bars.

    Returns:
        [`EvalReport`][dspark_hf.evaluation.report.EvalReport]: with the quality checks filled in.
    """
    mode = _check_arguments(target, drafts, repeats, max_new_tokens, temperatures, kernels)
    items = dict(prompts) if prompts is not None else {s: load_prompt_set(s, limit) for s in sets}
    per_draft = {"policy": policy, "cuda_graphs": cuda_graphs, "lookup": lookup, "compiled": compiled}
    calls = {name: {key: _for(value, name) for key, value in per_draft.items()} | {"kernels": mode} for name in drafts}
    lookup_tokens = prompt_lookup_num_tokens if prompt_lookup and 0 in temperatures else None
    methods = _methods(target, drafts, calls, packed_baseline, lookup_tokens)
    runner = _Runner(target, tokenizer, drafts, methods, calls, prompt_lookup_num_tokens)
    runner.warm_up(items, temperatures, min(8, max_new_tokens), seed)
    runs = [
        run
        for set_name, rows in items.items()
        for temp in temperatures
        for run in runner.run_set(set_name, rows, temp, max_new_tokens, repeats, seed, progress)
    ]
    settings = {"max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed, "kernels": mode}
    per_draft = {key: dict(value) if isinstance(value, Mapping) else value for key, value in per_draft.items()}
    report = EvalReport(_run_config(target, items, temperatures, settings | per_draft), methods, runs)
    report.quality = quality_checks(report, items, task_metrics=task_metrics)
    return report


def _for(value, name: str):
    """A per-draft argument's value for draft `name`: its mapping entry, or the one value every draft shares."""
    return value.get(name) if isinstance(value, Mapping) else value


def _check_arguments(target, drafts: Mapping, repeats, max_new_tokens, temperatures, kernels) -> str:
    """Refuse what cannot run, before any prompt does; return the kernel mode of the speculative runs."""
    from ..decoding.options import resolve_options

    reserved = {PLAIN, PROMPT_LOOKUP, *PLAIN_ON.values()} & set(drafts)
    if not drafts or reserved:
        raise ValueError(
            f"Got drafts named {sorted(drafts)}; pass at least one draft, and none named {PLAIN!r}, "
            f"{PLAIN_PACKED!r}, {PLAIN_EXACT!r}, {PLAIN_EXACT_BF16!r} or {PROMPT_LOOKUP!r} (those names are the "
            "baselines)."
        )
    if repeats < 1 or max_new_tokens < 1 or any(t < 0 for t in temperatures):
        raise ValueError(
            f"Got repeats={repeats}, max_new_tokens={max_new_tokens}, temperatures={list(temperatures)}; "
            "repeats and max_new_tokens must be >= 1 and temperatures >= 0."
        )
    return resolve_options(None, target, call={"kernels": kernels}).kernels


def _methods(target, drafts: Mapping, calls: dict, packed_baseline: bool | None, lookup_tokens: int | None) -> dict:
    """Every method the evaluation times, with what the report says of it. Each draft's options are resolved here,
    once: a bad value fails before any prompt runs, and the policy recorded is the one its calls resolve to."""
    from ..decoding.options import resolve_options

    mode = next(iter(calls.values()))["kernels"]
    methods = {PLAIN: {"kind": "plain", "kernels": "stock"}}
    if mode != "stock":
        methods[PLAIN_ON[mode]] = {"kind": f"plain_{mode}", "kernels": mode}
    if packed_baseline or (packed_baseline is None and mode == "packed"):
        methods[PLAIN_PACKED] = {"kind": "plain_packed", "kernels": "packed"}
    for name, draft in drafts.items():
        options = resolve_options(draft, target, call=calls[name])
        methods[name] = {
            "kind": "draft",
            "block_size": int(draft.config.block_size),
            "source": getattr(draft.config, "name_or_path", "") or "",
            "policy": repr(options.policy),
            "kernels": options.kernels,
        }
    if lookup_tokens is not None:  # transformers' prompt lookup decoding, a draft-free baseline (greedy only)
        methods[PROMPT_LOOKUP] = {"kind": "prompt_lookup", "num_tokens": lookup_tokens, "kernels": mode}
    return methods


def machine_name(device) -> str:
    """The machine a run measured, in words: the GPU's name, or the CPU's model and its core count."""
    import os
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{os.cpu_count()}-core {cpu}"


def _run_config(target, items: Mapping, temperatures: Sequence[float], settings: dict) -> dict:
    """The run's settings, as `report.config` records them (with the date and the machine, which plots name)."""
    import datetime

    import torch

    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(target.device),
        "target": getattr(target.config, "name_or_path", ""),
        "target_dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "device": str(target.device),
        "sets": {s: len(rows) for s, rows in items.items()},
        "temperatures": [float(t) for t in temperatures],
        "sampling": "plain temperature sampling (top_k=0, top_p=1.0); greedy at temperature 0",
        **settings,
        "torch_threads": torch.get_num_threads(),
        "timing": "per prompt, methods interleaved in every repeat; tokens/s = new tokens / median seconds, summed",
    }


def _last_stats(draft):
    """The statistics of `draft`'s last `generate()` call."""
    return last_generation_stats(draft)


class _Runner:
    """Times the methods of an evaluation on one prompt after another; every call carries its method's options
    on its `GenerationConfig` (`dspark_kernels` for the plain baselines, every option for a draft)."""

    def __init__(self, target, tokenizer, drafts: Mapping, methods: dict, calls: dict, lookup_tokens: int | None):
        self.target, self.tokenizer, self.drafts, self.methods, self.calls = target, tokenizer, drafts, methods, calls
        self.lookup_tokens = lookup_tokens or 10

    def active(self, temperature: float) -> list[str]:
        """The methods timed at `temperature`: prompt lookup decoding only greedily."""
        return [m for m in self.methods if m != PROMPT_LOOKUP or temperature == 0]

    def configs(self, temperature: float, max_new_tokens: int) -> dict:
        """Each method's `GenerationConfig` at `temperature`, its options as `dspark_*` attributes."""
        from ..decoding.options import config_key

        base, lookup = _generation_configs(self.target, self.tokenizer, temperature, max_new_tokens, self.lookup_tokens)
        configs = {}
        for method, info in self.methods.items():
            config = copy.deepcopy(lookup if method == PROMPT_LOOKUP else base)
            for name, value in self.calls.get(method, {"kernels": info["kernels"]}).items():
                if value is not None:  # unset: the draft's own default, else the library's
                    setattr(config, config_key(name), value)
            configs[method] = config
        return configs

    def run_once(self, inputs: dict, method: str, config, seed: int) -> tuple[list[int], float, list]:
        """One timed `generate()`: the new token ids, the seconds, and a draft's `(verified, accepted)` rounds."""
        import torch

        extra = {"assistant_model": self.drafts[method]} if method in self.drafts else {}
        torch.manual_seed(seed)
        synchronize(self.target.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(**inputs, generation_config=config, **extra)
        synchronize(self.target.device)  # a GPU runs asynchronously: count the work, not just its launch
        seconds = time.perf_counter() - start
        rounds = rounds_of(_last_stats(self.drafts[method])) if method in self.drafts else []
        return out[0, inputs["input_ids"].shape[1] :].tolist(), seconds, rounds

    def warm_up(self, items: Mapping, temperatures: Sequence[float], max_new_tokens: int, seed: int) -> None:
        """Run every method once on the first prompt (first-call allocations, lazy initialisation), unreported."""
        from ..default_model import chat_inputs

        first = next((rows[0] for rows in items.values() if rows), None)
        if first is None:
            return
        inputs = chat_inputs(self.tokenizer, first.prompt, self.target.device)
        for temp in temperatures:
            configs = self.configs(temp, max_new_tokens)
            for method in self.active(temp):
                self.run_once(inputs, method, configs[method], seed)
                if method in self.drafts and "cuda_graphs" not in self.methods[method]:
                    # whether the graph path ran, read right after the method's own run (methods NAME@... share
                    # one draft object, whose last statistics are the last method's)
                    self.methods[method]["cuda_graphs"] = _last_stats(self.drafts[method]).cuda_graphs

    def run_set(self, set_name: str, rows, temp: float, max_new_tokens: int, repeats: int, seed: int, progress: bool):
        """Every prompt of one set at one temperature, methods interleaved in every repeat; a [`PromptRun`] each."""
        from tqdm.auto import tqdm

        from ..default_model import chat_inputs

        configs, active, runs = self.configs(temp, max_new_tokens), self.active(temp), []
        bar = tqdm(rows, desc=f"{set_name} T={temp:g}", disable=not progress, leave=False)
        for index, item in enumerate(bar):
            inputs = chat_inputs(self.tokenizer, item.prompt, self.target.device)
            seconds, outputs = {m: [] for m in active}, {}
            for _ in range(repeats):
                for method in active:  # interleaved: every method sees the same machine load
                    ids, elapsed, rounds = self.run_once(inputs, method, configs[method], seed + index)
                    seconds[method].append(elapsed)
                    outputs[method] = (ids, rounds)
            for method, (ids, rounds) in outputs.items():
                reply = self.tokenizer.decode(ids, skip_special_tokens=True)
                runs.append(PromptRun(set_name, item.id, float(temp), method, seconds[method], ids, reply, rounds))
            taus = {m: ratio(sum(a + 1 for _, a in outputs[m][1]), len(outputs[m][1])) for m in self.drafts}
            bar.set_postfix({f"τ {m}": f"{t:.2f}" for m, t in taus.items()})
        return runs
