"""Kill-and-resume: a run killed (SIGKILL, no clean-up) mid-training and again mid-checkpoint-write continues
with exactly the losses and final weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from safetensors.torch import load_file

from train_helpers import make_char_tokenizer, make_chat_target, sampled_data

TESTS_DIR = Path(__file__).resolve().parents[1]  # tests/, where the helpers are

DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    import safetensors.torch
    from dspark_hf.train import DataArguments, ModelArguments, TrainArguments, train
    from train_helpers import make_chat_target

    data, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    callbacks = []
    if mode.startswith("kill-at-step-"):  # die right after an optimizer step, between two checkpoints
        step = int(mode.rsplit("-", 1)[1])
        callbacks.append(lambda state: state.step == step and os.kill(os.getpid(), signal.SIGKILL))
    if mode.startswith("kill-while-saving-"):  # die half-way through writing a checkpoint
        name = "checkpoint-" + mode.rsplit("-", 1)[1]
        original = safetensors.torch.save_file
        def dying_save(tensors, filename, *a, **kw):
            if name in str(filename) and str(filename).endswith("optimizer.safetensors"):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(tensors, filename, *a, **kw)
        safetensors.torch.save_file = dying_save
    train(
        ModelArguments(num_hidden_layers=1, block_size=4, markov_rank=16),
        DataArguments(train_data=data, num_anchors=12, eval_ratio=0.25),
        TrainArguments(output_dir=out, max_steps=10, per_device_batch_size=2, gradient_accumulation_steps=2,
                       learning_rate=0.01, warmup_ratio=0.2, save_steps=3, eval_steps=4, save_total_limit=2,
                       resume_from_checkpoint=None if mode == "fresh" else "auto", report_to="none", progress=False),
        target=make_chat_target(),
        callbacks=callbacks,
    )
    """
)


def _launch(driver: Path, data: Path, out: Path, mode: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.Popen(
        [sys.executable, str(driver), str(data), str(out), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(proc: subprocess.Popen) -> int:
    _, err = proc.communicate(timeout=240)
    if proc.returncode not in (0, -9):
        raise AssertionError(err[-3000:])
    return proc.returncode


def _metrics(out: Path) -> list[str]:
    """Every logged number except wall-clock throughput, as JSON text (so floats compare to the last digit)."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if not k.endswith("_per_s")}
        rows.append(json.dumps(row))
    return rows


def test_kill_and_resume_continues_identically(tmp_path):
    tok, target = make_char_tokenizer(), make_chat_target()
    prompts = [f"prompt {i}" for i in range(12)] + [*map(str, range(4))]
    data = Path(sampled_data(tmp_path / "data.jsonl", target, tok, prompts))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    ref, run = tmp_path / "reference", tmp_path / "interrupted"

    reference = _launch(driver, data, ref, "fresh")
    assert _wait(_launch(driver, data, run, "kill-at-step-5")) == -9
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 5

    assert _wait(_launch(driver, data, run, "kill-while-saving-6")) == -9
    assert (run / ".tmp-checkpoint-6").is_dir() and not (run / "checkpoint-6").exists()  # the torn save

    assert _wait(_launch(driver, data, run, "resume")) == 0  # resumes from checkpoint-3 again
    assert _wait(reference) == 0

    assert _metrics(run) == _metrics(ref)
    assert len([r for r in _metrics(ref) if '"train"' in r]) == 10
    final_ref, final_run = load_file(ref / "model.safetensors"), load_file(run / "model.safetensors")
    assert final_ref.keys() == final_run.keys()
    assert all(final_ref[k].equal(final_run[k]) for k in final_ref)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-9"]  # save_total_limit
    assert not list(run.glob(".tmp-*"))
    # the cost on the draft's folder adds up the resumed parts: the same steps and tokens as the uninterrupted run
    cost_ref, cost_run = (json.loads((d / "training_cost.json").read_text()) for d in (ref, run))
    assert cost_ref["steps"] == cost_run["steps"] == 10
    assert cost_run["tokens"] == cost_ref["tokens"] > 0 and cost_run["slots"] == cost_ref["slots"] > 0
    assert cost_run["cpu_seconds"] > 0 and cost_run["tokens_per_s"] > 0
