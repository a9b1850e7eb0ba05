"""Data preparation: prompt formats, the assistant loss mask, multi-turn regeneration, resume; arguments."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from dspark_hf.train import data as data_mod
from dspark_hf.train.args import (
    PREPARE_ARGUMENT_TYPES,
    TRAIN_ARGUMENT_TYPES,
    PrepareDataArguments,
    make_dataclasses,
    parse_args,
    require,
)
from dspark_hf.train.data import TokenDataset, load_token_dataset, prepare_data, to_conversation, tokenize_conversation
from train_helpers import PROMPTS, make_char_tokenizer, make_chat_target, sampling_args, write_prompts


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("hi", [{"role": "user", "content": "hi"}]),
        ({"prompt": "hi"}, [{"role": "user", "content": "hi"}]),
        ({"question": "q", "answer": "a"}, [{"role": "user", "content": "q"}]),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "x"},
                    {"role": "user", "content": "b"},
                ]
            },
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        ),
        (
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "a"},
                    {"from": "gpt", "value": "x"},
                ]
            },
            [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}],
        ),
    ],
)
def test_to_conversation_formats(row, expected):
    assert to_conversation(row) == expected


def test_to_conversation_errors_name_the_fix():
    with pytest.raises(ValueError, match="prompt_field"):
        to_conversation({"foo": "bar"})
    with pytest.raises(ValueError, match="no user message"):
        to_conversation({"messages": [{"role": "system", "content": "s"}]})


def test_loss_mask_marks_exactly_the_assistant_turns():
    tok = make_char_tokenizer()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo!"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"},
    ]
    ((ids, mask),) = tokenize_conversation(tok, messages)
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    masked = [i if m else None for i, m in zip(ids, mask)]
    runs, cur = [], []
    for t in masked + [None]:
        if t is None and cur:
            runs.append(tok.decode(cur))
            cur = []
        elif t is not None:
            cur.append(t)
    assert runs == ["yo!<|im_end|>", "ok<|im_end|>"]  # content through end-of-turn, not the newline after it
    # A turn cut off by max_new_tokens never produced its end-of-turn token: it is not supervised.
    ((ids2, mask2),) = tokenize_conversation(tok, messages, truncated=[True, False])
    assert ids2 == ids and tok.decode([i for i, m in zip(ids2, mask2) if m]) == "yo!ok<|im_end|>"


def test_template_that_rewrites_history_falls_back_to_one_sequence_per_turn():
    tok = make_char_tokenizer()
    # Like reasoning templates that drop earlier turns' content: history renders differently from the last turn.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}.{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "xy"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "zw"},
    ]
    seqs = tokenize_conversation(tok, messages)
    assert len(seqs) == 2
    for (ids, mask), content in zip(seqs, ["xy", "zw"]):
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == content + "<|im_end|>"


def _prep_args(tmp_path, **kw):
    base = dict(prompts=write_prompts(tmp_path / "prompts.jsonl"), output=tmp_path / "data.jsonl", max_new_tokens=12)
    base.update(batch_size=3)
    base.update(kw)
    if base.get("backend") == "bulk":
        base.setdefault("generation_dtype", "float32")  # the tiny fp32 target's own arithmetic: greedy comparable
        base["batch_size"] = kw.get("batch_size", 2)  # 2 rows refilled from chunks of 3 conversations
        base.setdefault("chunk_size", 3)
    return sampling_args(**base)


@pytest.mark.parametrize("backend", ["bulk", "engine", "generate"])
def test_prepare_data_answers_each_user_turn_with_the_target(tmp_path, backend):
    tok, target = make_char_tokenizer(), make_chat_target()
    path = prepare_data(_prep_args(tmp_path, do_sample=False, backend=backend), target=target, tokenizer=tok)
    records = [json.loads(line) for line in open(path)]
    assert [r["id"] for r in records] == list(range(len(PROMPTS)))
    multi = records[3]["messages"]  # two user turns, the given assistant answer "old" replaced
    assert [m["role"] for m in multi] == ["user", "assistant", "user", "assistant"]
    assert "old" not in multi[1]["content"]
    # Greedy: the second answer is exactly the target's continuation of the history with the first answer.
    prompt = tok.apply_chat_template(multi[:3], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = target.generate(**prompt, max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=1)
    expected = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert multi[3]["content"] == expected
    seq = records[3]["sequences"][0]
    assert len(seq["input_ids"]) == len(seq["loss_mask"]) and sum(seq["loss_mask"]) > 0
    assert records[2]["messages"][0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("backend", ["bulk", "engine", "generate"])
def test_prepare_data_resumes_to_the_same_output(tmp_path, monkeypatch, backend):
    tok, target = make_char_tokenizer(), make_chat_target()
    full = prepare_data(
        _prep_args(tmp_path, output=str(tmp_path / "a.jsonl"), backend=backend), target=target, tokenizer=tok
    )
    args = _prep_args(tmp_path, output=str(tmp_path / "b.jsonl"), backend=backend)

    calls = {"n": 0}
    original = data_mod.regenerate_conversations

    def dying(*a, **kw):  # the "process" dies while generating the second batch
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(*a, **kw)

    monkeypatch.setattr(data_mod, "regenerate_conversations", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(args, target=target, tokenizer=tok)
    with open(args.output, "a") as f:  # and left a torn line behind
        f.write('{"id": 3, "messa')
    monkeypatch.setattr(data_mod, "regenerate_conversations", original)
    resumed = prepare_data(args, target=target, tokenizer=tok)
    assert open(resumed).read() == open(full).read()


def test_engine_backend_matches_one_at_a_time_decoding(tmp_path):
    """Greedy: each response of the batched engine (on the exact kernels, the default for this float32 target)
    is the target's own greedy continuation of that prompt alone on the same kernels (the same check as above,
    for every record). Sampling: each conversation turn has its own seed, so a conversation's responses do not
    depend on the chunk it was generated in."""
    tok, target = make_char_tokenizer(), make_chat_target()
    path = prepare_data(
        _prep_args(tmp_path, do_sample=False, batch_size=8, backend="engine"), target=target, tokenizer=tok
    )
    records = [json.loads(line) for line in open(path)]
    assert len(records) == len(PROMPTS)
    checked = 0
    for record in records:
        messages = record["messages"]
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(
                messages[:k], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            out = target.generate(
                **prompt, max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=1, dspark_kernels="exact"
            )
            assert m["content"] == tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            checked += 1
    assert checked == len(PROMPTS) + 1  # one conversation has two user turns

    sampled = {}
    for size in (1, 3, 8):
        args = _prep_args(tmp_path, output=str(tmp_path / f"s{size}.jsonl"), batch_size=size, backend="engine")
        out = prepare_data(args, target=target, tokenizer=tok)
        sampled[size] = [json.loads(line)["messages"] for line in open(out)]
    assert sampled[1] == sampled[3] == sampled[8]
    assert len({json.dumps(m) for m in sampled[8]}) == len(PROMPTS)  # not a constant answer


KILL_DRIVER = """
import os, signal, sys
import torch
torch.set_num_threads(1)
from dspark_hf.train import data as data_mod
from dspark_hf.train.args import PrepareDataArguments
from train_helpers import PROMPTS, make_char_tokenizer, make_chat_target

out, kill_at, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
calls = [0]
name = backend + "_turn"
original = getattr(data_mod, name)
def dying(*a, **kw):  # SIGKILL (no clean-up) in the middle of generating a chunk
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*a, **kw)
setattr(data_mod, name, dying)
args = PrepareDataArguments(output=out, max_new_tokens=12, batch_size=3, temperature=1.0, top_p=1.0, top_k=0,
                            device="cpu", progress=False, backend=backend, chunk_size=3, generation_dtype="float32")
data_mod.prepare_data(args, target=make_chat_target(), tokenizer=make_char_tokenizer(), prompts=PROMPTS)
"""


@pytest.mark.parametrize("backend", ["bulk", "engine", "generate"])
def test_prepare_data_killed_mid_chunk_resumes_to_the_same_file(tmp_path, backend):
    """A SIGKILLed prepare-data leaves the chunks it finished; rerunning the same command completes the file
    byte-identically to an uninterrupted run."""
    import os
    from pathlib import Path

    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER)
    tests_dir = Path(__file__).resolve().parents[1]  # tests/, where the helpers are
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{tests_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }

    def run(out, kill_at):
        proc = subprocess.run(
            [sys.executable, str(driver), str(out), str(kill_at), backend],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        return proc.returncode, proc.stderr

    full, partial = tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    assert run(full, 0)[0] == 0
    # Chunks of 3 conversations; conversation 3 has two user turns, so the 2nd chunk makes 2 calls; the 3rd
    # call is the second turn of chunk 2: chunk 1 is written, chunk 2 half-generated.
    code, err = run(partial, 3)
    assert code == -9, err[-2000:]
    written = [json.loads(line)["id"] for line in partial.read_text().splitlines()]
    assert written == [0, 1, 2]
    assert run(partial, 0)[0] == 0
    assert partial.read_bytes() == full.read_bytes()


def test_prepare_data_accepts_dataset_rows_and_max_turns(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, {"prompt": "c"}]
    tok, target = make_char_tokenizer(), make_chat_target()
    path = prepare_data(_prep_args(tmp_path, max_turns=1), target=target, tokenizer=tok, prompts=iter(rows))
    records = [json.loads(line) for line in open(path)]
    assert [len(r["messages"]) for r in records] == [2, 2]


def test_token_dataset_truncates_drops_and_splits(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        {"sequences": [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}]},
        {"input_ids": [1, 2, 3], "loss_mask": [1, 0, 1]},  # no anchor: dropped
        {"input_ids": list(range(10)), "loss_mask": [1] * 10},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ds = load_token_dataset(str(path), max_seq_len=6)
    assert len(ds) == 2 and ds.num_tokens == 5 + 6
    ids, mask = ds[1]
    assert ids.tolist() == list(range(6)) and mask.all()
    train, held = TokenDataset([([i, i], [1, 1]) for i in range(10)]).split(0.3, seed=1)
    assert len(train) == 7 and len(held) == 3
    again = TokenDataset([([i, i], [1, 1]) for i in range(10)]).split(0.3, seed=1)[1]
    assert held.fingerprint() == again.fingerprint()


def test_prepare_data_backend_is_checked():
    with pytest.raises(ValueError, match="backend must be 'bulk', 'engine' or 'generate', got 'vllm'"):
        PrepareDataArguments(output="x.jsonl", backend="vllm")


def test_yaml_config_with_command_line_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: dflash\ntraining:\n  learning_rate: 0.001\n  max_steps: 5\nnum_anchors: 64\n")
    model, data, train, lora = parse_args(TRAIN_ARGUMENT_TYPES, ["--config", str(cfg), "--max_steps", "9"])
    assert model.preset == "dflash" and model.sequential_head == "none" and model.confidence_head is False
    assert train.learning_rate == 0.001 and train.max_steps == 9 and data.num_anchors == 64 and not lora.lora
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        make_dataclasses(TRAIN_ARGUMENT_TYPES, {"learning_rat": 1})
    with pytest.raises(ValueError, match="mixed_precision"):
        make_dataclasses(TRAIN_ARGUMENT_TYPES, {"mixed_precision": "fp8"})
    (prep,) = parse_args(
        PREPARE_ARGUMENT_TYPES, ["--prompts", "p.jsonl", "--chat_template_kwargs", '{"enable_thinking": false}']
    )
    assert prep.chat_template_kwargs == {"enable_thinking": False}


def test_missing_optional_dependency_names_the_extra():
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[train]'")):
        require("surely_not_an_installed_module_xyz")


def test_import_dspark_hf_does_not_import_the_train_package():
    code = "import sys, dspark_hf; print('dspark_hf.train' in sys.modules, 'peft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    assert torch.__version__  # torch itself is of course fine


def test_prepare_data_kernels_option(tmp_path, monkeypatch):
    """`kernels` picks what the engine decodes on (default: exact for a float32 CPU target); a bad name is refused."""
    from dspark_hf.decoding import engine as engine_mod
    from dspark_hf.kernels import default_kernels

    seen = []
    original = engine_mod.DSparkEngine.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("kernels"))
        original(self, *a, **kw)

    monkeypatch.setattr(engine_mod.DSparkEngine, "__init__", spy)
    tok, target = make_char_tokenizer(), make_chat_target()
    assert default_kernels(target) == "exact"
    for kernels in (None, "stock"):
        args = _prep_args(tmp_path, output=str(tmp_path / f"{kernels}.jsonl"), kernels=kernels, backend="engine")
        rows = [json.loads(line) for line in open(prepare_data(args, target=target, tokenizer=tok))]
        assert len(rows) == len(PROMPTS)
    assert seen == ["exact", "stock"]
    with pytest.raises(ValueError, match="kernels must be"):
        PrepareDataArguments(output="x.jsonl", kernels="fast")
