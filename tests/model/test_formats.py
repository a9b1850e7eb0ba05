"""Every released DSpark draft loads, and none loads silently wrong (issue 18).

* rotary scaling (YaRN, llama3, a `rope_theta` override) and the activation (GELU) are honoured: an import of
  a checkpoint in DeepSpec's layout matches an independent restatement of DeepSpec's model
  (`tests/deepspec_reference.py`) within 1e-5 in fp32, and an export makes DeepSpec compute what we compute;
  negative controls show the comparison would catch plain rotary / SiLU;
* Gemma4 drafts (`Gemma4DSparkModel`): import, export, the reference, greedy `generate()` on a tiny Gemma4;
* format detection reads `architectures`; unsupported settings are refused;
* `-1` in `target_layer_ids` (the embedding output) end to end;
* the target-copy fingerprint warns for a mismatched target and is silent for the right one.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dspark_hf import DSparkDraftModel, DSparkEngine, SamplingParams, export_deepspec, last_generation_stats
from dspark_hf.train.features import target_features

from deepspec_reference import block_inputs, max_diff, ours, reference_forward, write_deepspec_checkpoint
from helpers import LLAMA3, REFERENCE_TOL, assert_export_round_trip, make_gemma4_target, make_target, randomize

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
TARGETS = {  # Qwen3 targets as DeepSpec supports; rotary/activation as the families that use them
    "yarn": dict(rope_parameters=YARN),
    "llama3": dict(rope_parameters=LLAMA3),
    "gelu": dict(hidden_act="gelu"),
    "default": {},
}


def _qwen3_target(kind: str, seed: int = 0):
    return make_target("qwen3", dtype=torch.float32, seed=seed, **TARGETS[kind])


def _fingerprint_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "stores copies of its target" in str(w.message)]


# ---------------------------------------------------------------------- DeepSpec's layout → our draft
@pytest.mark.parametrize("kind", list(TARGETS))
def test_deepspec_layout_import_matches_deepspec_reference(tmp_path, kind):
    target = _qwen3_target(kind)
    write_deepspec_checkpoint(tmp_path, target, target_layer_ids=[1, 3])
    draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert draft.config.rope_parameters["rope_type"] == TARGETS[kind].get("rope_parameters", {}).get(
        "rope_type", "default"
    )
    assert draft.config.hidden_act == TARGETS[kind].get("hidden_act", "silu")
    inputs = block_inputs(draft)
    got, ref = ours(draft, *inputs), reference_forward(tmp_path, *inputs)
    for a, b in zip(got, ref):
        assert max_diff(a, b) <= REFERENCE_TOL, (kind, max_diff(a, b))


@pytest.mark.parametrize("kind", ["yarn", "llama3", "gelu"])
def test_reference_comparison_has_power(tmp_path, kind):
    """Negative control: DeepSpec computed with plain rotary / SiLU differs from the import by far more than
    REFERENCE_TOL."""
    target = _qwen3_target(kind)
    write_deepspec_checkpoint(tmp_path, target, target_layer_ids=[1, 3])
    draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    inputs = block_inputs(draft)
    if kind == "gelu":
        wrong = reference_forward(tmp_path, *inputs, act="silu")
    else:
        wrong = reference_forward(tmp_path, *inputs, rope_override={"rope_type": "default", "rope_theta": 10000.0})
    assert max_diff(ours(draft, *inputs)[1], wrong[1]) > 1e-2


# ---------------------------------------------------------------------- our draft → DeepSpec's layout
@pytest.mark.parametrize(
    "arch, kind",
    [("qwen3", "yarn"), ("llama", "llama3"), ("qwen3", "gelu"), ("llama", "yarn")],
)
def test_export_import_round_trip_and_deepspec_computes_the_same(tmp_path, arch, kind):
    target = make_target(arch, dtype=torch.float32, **TARGETS[kind])
    draft = randomize(DSparkDraftModel.from_target(target, num_hidden_layers=2, block_size=4, markov_rank=16))
    assert draft.config.rope_parameters["rope_type"] == TARGETS[kind].get("rope_parameters", {}).get(
        "rope_type", "default"
    )
    export_deepspec(draft, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in written and "rope_scaling" not in written  # one rotary, in rope_parameters
    assert written["rope_parameters"] == draft.config.rope_parameters
    assert written["hidden_act"] == draft.config.hidden_act
    assert_export_round_trip(draft, DSparkDraftModel.from_pretrained(tmp_path, target=target), tmp_path)


def test_rope_theta_override_is_exported_where_transformers_reads_it(tmp_path):
    target = _qwen3_target("yarn")
    draft = randomize(DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, rope_theta=5e5))
    assert draft.config.rope_parameters == {**YARN, "rope_theta": 5e5}
    export_deepspec(draft, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == 5e5 and "rope_theta" not in written
    inputs = block_inputs(draft)
    assert max_diff(ours(draft, *inputs)[1], reference_forward(tmp_path, *inputs)[1]) <= REFERENCE_TOL


def test_draft_layers_rotate_like_the_targets_rotary_class():
    """The draft's cos/sin equal transformers' own rotary class of the target, for each rotary type."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    for kind in ("yarn", "llama3", "default"):
        target = _qwen3_target(kind)
        draft = DSparkDraftModel.from_target(target, num_hidden_layers=1)
        positions = torch.arange(0, 300, 7)[None]
        cos, sin = draft.layers[0].self_attn.rotary.cos_sin(positions, torch.float32)
        ref_cos, ref_sin = Qwen3RotaryEmbedding(target.config)(torch.zeros(1, dtype=torch.float32), positions)
        assert torch.allclose(cos[:, 0], ref_cos, atol=1e-6) and torch.allclose(sin[:, 0], ref_sin, atol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["Qwen3Eagle3Model"]}, "architectures"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "full-attention only"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "sequence length"),
        ({"hidden_act": "not_an_activation"}, "ACT2FN"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
    ],
)
def test_unsupported_deepspec_settings_are_refused(tmp_path, change, match):
    target = _qwen3_target("default")
    cfg = write_deepspec_checkpoint(tmp_path, target, target_layer_ids=[1, 3])
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=match):
        DSparkDraftModel.from_pretrained(tmp_path, target=target)


# ---------------------------------------------------------------------- Gemma4
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_deepspec_layout_import_matches_reference(tmp_path, k_eq_v):
    target = make_gemma4_target(k_eq_v)
    write_deepspec_checkpoint(tmp_path, target, target_layer_ids=[1, 3])
    draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    c = draft.config
    assert (c.layer_style, c.head_dim, c.attention_k_eq_v) == ("gemma4", 16, k_eq_v)
    assert c.rope_parameters["rope_type"] == "proportional" and c.hidden_act == "gelu_pytorch_tanh"
    inputs = block_inputs(draft)
    for a, b in zip(ours(draft, *inputs), reference_forward(tmp_path, *inputs)):
        assert max_diff(a, b) <= REFERENCE_TOL


def test_gemma4_reference_comparison_has_power(tmp_path):
    target = make_gemma4_target()
    write_deepspec_checkpoint(tmp_path, target, target_layer_ids=[1, 3])
    draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    inputs = block_inputs(draft)
    wrong = reference_forward(tmp_path, *inputs, rope_override={"rope_type": "default", "rope_theta": 1e6})
    assert max_diff(ours(draft, *inputs)[1], wrong[1]) > 1e-2


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_export_import_round_trip(tmp_path, k_eq_v):
    target = make_gemma4_target(k_eq_v)
    draft = randomize(DSparkDraftModel.from_target(target, num_hidden_layers=2, block_size=4, markov_rank=16))
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            layer.layer_scalar.fill_(0.7 + 0.1 * i)
    export_deepspec(draft, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["Gemma4DSparkModel"] and written["model_type"] == "gemma4_text"
    assert (
        written["global_head_dim"] == 16 and written["rope_parameters"]["full_attention"]["rope_type"] == "proportional"
    )
    assert_export_round_trip(draft, DSparkDraftModel.from_pretrained(tmp_path, target=target), tmp_path)


@pytest.mark.parametrize("source", ["from_target", "deepspec_import"])
def test_gemma4_greedy_generate_identical_to_plain(tmp_path, source):
    target = make_gemma4_target(dtype=torch.float64)
    if source == "from_target":
        draft = DSparkDraftModel.from_target(target, num_hidden_layers=2, block_size=4)
    else:
        write_deepspec_checkpoint(tmp_path, target, target_layer_ids=[-1, 3], dtype=torch.float64)
        draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    torch.manual_seed(5)
    prompt = torch.randint(0, 95, (1, 6))
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)  # > sliding window: the cache rolls over
    spec = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert torch.equal(plain, spec)
    assert last_generation_stats(draft).rounds


# ---------------------------------------------------------------------- -1: the embedding output
def test_embedding_layer_id_end_to_end(monkeypatch):
    target = make_target("llama", markov=True)
    draft = DSparkDraftModel.from_target(target, target_layer_ids=[-1, 2], num_hidden_layers=1, block_size=4)
    prompt = torch.tensor([[3, 14, 15, 9, 26, 5]])
    seen = []
    project = draft.project_context

    def spy(features):
        seen.append(features if not isinstance(features, (list, tuple)) else torch.cat(list(features), -1))
        return project(features)

    monkeypatch.setattr(draft, "project_context", spy)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    spec = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert torch.equal(plain, spec)
    d = target.config.hidden_size
    embedded = target.get_input_embeddings()(prompt)
    assert torch.equal(seen[0][..., :d], embedded)  # feature block 0 of the prefill is the embedding output
    # the engine (continuous batching) reads the same features
    engine = DSparkEngine(target, draft, max_batch_size=2)
    (out,) = engine.generate([prompt[0].tolist()], SamplingParams(max_new_tokens=20))
    assert out.ok and out.token_ids == plain[0, prompt.shape[1] :].tolist()
    assert out.stats.rounds
    # training features: block 0 is the embedding output, block 1 layer 2's output
    feats = target_features(target, [-1, 2], prompt)
    hidden = target(prompt, output_hidden_states=True).hidden_states
    assert torch.equal(feats.context[..., :d], hidden[0]) and torch.equal(feats.context[..., d:], hidden[3])


# ---------------------------------------------------------------------- the target-copy fingerprint
def test_fingerprint_warns_for_another_target_and_not_for_the_right_one(tmp_path):
    right = _qwen3_target("default", seed=0)
    other = _qwen3_target("default", seed=7)  # same shapes, other weights
    other.config._name_or_path = "someone/other-target"
    write_deepspec_checkpoint(tmp_path / "ckpt", right, target_layer_ids=[1, 3], dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        draft = DSparkDraftModel.from_pretrained(tmp_path / "ckpt", target=right)  # bf16 copies, fp32 target
        draft.bind_target(right)
    assert _fingerprint_warnings(record) == []
    with pytest.warns(UserWarning, match="stores copies of its target") as record:
        DSparkDraftModel.from_pretrained(tmp_path / "ckpt", target=other)  # on import
    message = _fingerprint_warnings(record)[0]
    assert str(tmp_path / "ckpt") in message and "someone/other-target" in message
    assert "embed_tokens and lm_head" in message
    with pytest.warns(UserWarning, match="stores copies of its target"):
        draft.bind_target(other)  # on bind_target
    # the fingerprint travels with our own format
    draft.save_pretrained(tmp_path / "ours")
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "ours")
    with pytest.warns(UserWarning, match="stores copies of its target"):
        reloaded.bind_target(other)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reloaded.bind_target(right)
    assert _fingerprint_warnings(record) == []


# ---------------------------------------------------------------------- the format page lists every field
def test_deepspec_format_page_lists_every_config_field(tmp_path):
    """Every field of a DeepSpec Qwen3 / Gemma4 draft config appears on docs/deepspec-format.md."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "deepspec-format.md").read_text(encoding="utf-8")
    fields = set()
    for target in (_qwen3_target("yarn"), make_gemma4_target()):
        fields |= set(write_deepspec_checkpoint(tmp_path / type(target).__name__, target, target_layer_ids=[1, 3]))
    fields |= {"rope_theta", "rope_scaling", "partial_rotary_factor", "per_layer_config", "_name_or_path"}
    fields |= {"target_name_or_path", "dspark_calibration_temperatures", "dspark_confidence_calibrated", "dtype"}
    missing = sorted(f for f in fields if f"`{f}`" not in page)
    assert not missing, f"fields not documented on docs/deepspec-format.md: {missing}"
