"""Clear `ValueError`s for bad input: what was given, what is allowed, how to fix it."""

from __future__ import annotations

import pytest
import torch

from dspark_hf import DSparkConfig, DSparkDraftModel, default_target_layer_ids

from helpers import make_target


def _cfg(**kw):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_num_hidden_layers=8,
        num_hidden_layers=1,
        markov_rank=8,
    )
    base.update(kw)
    return DSparkConfig(**base)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"target_layer_ids": [1, 9]}, "out of range"),
        ({"target_layer_ids": [7]}, "final layer is excluded"),
        ({"target_layer_ids": [3, 1]}, "strictly increasing"),
        ({"target_layer_ids": [1, 1]}, "strictly increasing"),
        ({"target_layer_ids": [-2, 2]}, "0-based layer indices and -1"),
        ({"target_layer_ids": [2, -1]}, "strictly increasing"),
        ({"hidden_act": "swish2"}, "ACT2FN"),
        ({"layer_style": "llama"}, "'qwen3', 'gemma4'"),
        ({"attention_k_eq_v": True}, "layer_style='gemma4'"),
        ({"final_logit_softcapping": -1.0}, "softcapping"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "sequence length"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "sequence length"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "Supported: default"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
        ({"target_layer_ids": []}, "empty"),
        ({"sequential_head": "lstm"}, "'markov', 'gated', 'rnn', 'none'"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"markov_rank": 0}, "markov_rank"),
        ({"mask_token_id": 64}, "outside the vocabulary"),
        ({"calibration_temperatures": [1.0, 1.0]}, "one temperature per block position"),
        ({"calibration_temperatures": [0.0] * 7}, "> 0"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"target_hidden_size": 48}, "shares the target's embedding"),
        ({"target_vocab_size": 65}, "shares the target's vocabulary"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kwargs)


def test_config_needs_layers_or_depth():
    with pytest.raises(ValueError, match="from_target"):
        DSparkConfig(vocab_size=64, hidden_size=32)


def test_default_layer_ids_rule():
    # paper rule: round(1 + i·(L−4)/(m−1)), i = 0..m−1, never the final layer
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-4B / 8B, as in DeepSpec
    assert default_target_layer_ids(40) == [1, 10, 19, 28, 37]  # Qwen3-14B
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_target_layer_ids(30, 1) == [15]
    for layers in range(2, 50):
        ids = default_target_layer_ids(layers)
        assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] <= layers - 2


@pytest.mark.parametrize(
    "field, value, match", [("vocab_size", 80, "vocabulary mismatch"), ("hidden_size", 48, "hidden-size mismatch")]
)
def test_draft_target_shape_mismatch(field, value, match):
    target = make_target("llama")
    other = make_target("llama", **{field: value})
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    with pytest.raises(ValueError, match=match):
        draft.bind_target(other)
    with pytest.raises(ValueError, match=match):
        other.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=3, assistant_model=draft)


def test_draft_layers_beyond_target_depth():
    target = make_target("llama", num_layers=6)
    shallow = make_target("llama", num_layers=3)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8, target_layer_ids=[1, 4])
    with pytest.raises(ValueError, match="do not fit a target with 3 layers"):
        draft.bind_target(shallow)


def test_other_target_name_warns():
    target = make_target("llama")
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8, target_name_or_path="org/ModelA")
    target.config._name_or_path = "org/ModelB"
    with pytest.warns(UserWarning, match="built for target 'org/ModelA'"):
        draft.bind_target(target)


def test_batch_generate_points_to_engine():
    target = make_target("llama")
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    with pytest.raises(ValueError, match="batched engine"):
        target.generate(torch.zeros(2, 4, dtype=torch.long), max_new_tokens=3, assistant_model=draft)


def test_unbound_draft_explains():
    target = make_target("llama")
    draft = DSparkDraftModel(DSparkConfig.from_target(target, num_hidden_layers=1, markov_rank=8))
    with pytest.raises(RuntimeError, match="bind_target"):
        draft.embed_tokens(torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("spec", ["fastest", "fixed:x", "threshold:2"])
def test_bad_policy(spec):
    from dspark_hf import resolve_policy

    with pytest.raises(ValueError):
        resolve_policy(spec)


def test_threshold_without_confidence_head():
    target = make_target("llama")
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8, confidence_head=False)
    draft.generation_config.dspark_policy = "threshold:0.5"
    with pytest.raises(ValueError, match="confidence head"):
        target.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=3, assistant_model=draft)


def test_convert_default_target_refuses_another_file(tmp_path):
    from dspark_hf.default_model import convert_default_target

    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        convert_default_target(other, tmp_path / "out")
    with pytest.raises(ValueError, match="expected the default target's GGUF file"):
        convert_default_target(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "out")  # missing
    assert not (tmp_path / "out").exists()
