"""Checkpoints: save/load round trip, AutoModel without trust_remote_code, DeepSpec export/import, no pickles."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

from dspark_hf import DSparkConfig, DSparkDraftModel, export_deepspec
from dspark_hf.model.formats import is_deepspec_checkpoint

from helpers import make_aligned_draft, make_target


def _block_logits(draft, seed=0):
    """Teacher-forced logits and confidences of two packed blocks on random context features."""
    from dspark_hf.model.modeling import block_attention_mask

    gen = torch.Generator().manual_seed(seed)
    c = draft.config
    ctx_len, gamma = 12, c.block_size
    feats = torch.randn(1, ctx_len, c.num_target_features * c.hidden_size, generator=gen, dtype=draft.dtype)
    anchors = torch.tensor([[4, 9]])
    ids = torch.randint(0, c.vocab_size, (1, 2 * gamma), generator=gen)
    positions = (anchors[:, :, None] + torch.arange(gamma)).reshape(1, -1)
    mask = block_attention_mask(anchors, ctx_len, gamma)
    with torch.no_grad():
        out = draft(feats, ids, positions, prev_token_ids=ids, attention_mask=mask)
    return out.logits, out.confidence_logits


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_save_load_bit_identical(tmp_path, head):
    target = make_target("qwen3")
    draft = make_aligned_draft(target, head)
    draft.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in saved), "target weights must not be saved"
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    for a, b in zip(_block_logits(draft), _block_logits(loaded)):
        if a is not None:
            assert torch.equal(a, b)
    ids = torch.randint(0, 96, (1, 9))
    out_a = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    out_b = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=loaded)
    assert torch.equal(out_a, out_b)


def test_automodel_without_trust_remote_code(tmp_path):
    target = make_target("llama")
    draft = make_aligned_draft(target, "markov")
    draft.config.calibration_temperatures = [1.5] * draft.config.block_size
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "dspark" and "auto_map" not in config
    assert config["target_num_hidden_layers"] == 6 and config["dspark_version"]
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DSparkConfig)
    model = AutoModel.from_pretrained(tmp_path)
    assert isinstance(model, DSparkDraftModel)
    assert model.config.calibration_temperatures == [1.5] * draft.config.block_size
    ids = torch.randint(0, 96, (1, 7))
    # loaded without a target: generate() binds it automatically
    assert not model.is_bound
    out = target.generate(ids, max_new_tokens=15, do_sample=False, assistant_model=model.to(torch.float64))
    assert torch.equal(out, target.generate(ids, max_new_tokens=15, do_sample=False))
    assert model.bound_target is target


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_deepspec_export_import_round_trip(tmp_path, head):
    target = make_target("qwen3")
    draft = make_aligned_draft(target, head)
    draft.config.calibration_temperatures = [1.25] * draft.config.block_size
    draft.config.confidence_calibrated = True
    export_deepspec(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == draft.config.block_size and cfg["target_layer_ids"] == draft.config.target_layer_ids
    assert cfg["markov_rank"] == (0 if head == "none" else draft.config.markov_rank)
    weights = load_file(tmp_path / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight)
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert "fc.weight" in weights and "layers.0.self_attn.q_norm.weight" in weights
    assert is_deepspec_checkpoint(str(tmp_path))
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)  # auto-detected
    assert loaded.config.sequential_head == head
    assert loaded.config.calibration_temperatures == [1.25] * draft.config.block_size
    assert loaded.config.confidence_calibrated
    for a, b in zip(_block_logits(draft), _block_logits(loaded)):
        if a is not None:
            assert torch.equal(a, b)
    # and back again: a second export is byte-for-byte the same tensors
    export_deepspec(loaded, tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)


def test_export_tied_embeddings_target(tmp_path):
    """SmolLM2-style targets tie embedding and LM head; the export must still write both tensors."""
    target = make_target("llama")
    target.lm_head.weight = target.get_input_embeddings().weight
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    export_deepspec(draft, tmp_path)
    w = load_file(tmp_path / "model.safetensors")
    assert torch.equal(w["lm_head.weight"], w["embed_tokens.weight"])


def test_pickle_checkpoint_refused(tmp_path):
    target = make_target("llama")
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    draft.config.save_pretrained(tmp_path)
    torch.save(draft.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        DSparkDraftModel.from_pretrained(tmp_path)
