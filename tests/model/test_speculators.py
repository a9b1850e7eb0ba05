"""The speculators format (vLLM's `speculators` library): import for `generate(assistant_model=...)`, export.

A checkpoint is written here the way speculators' `DSparkDraftModel` saves one (its config fields and weight
names, read from the library's source), independently of `export_speculators`; the import must match the
DeepSpec/speculators reference forward within 1e-5 and give greedy `generate()` identical to plain, also with a
draft vocabulary (`t2d` / `d2t`) and with `-1` (aux layer 0, the embedding output). Our export round-trips
exactly and is read back by the same reference.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dspark_hf import DSparkDraftModel, export_speculators, load_speculators_checkpoint

from deepspec_reference import block_inputs, max_diff, ours, reference_forward
from helpers import LLAMA3, REFERENCE_TOL, assert_export_round_trip, make_gemma4_target, make_target, randomize


def write_speculators_checkpoint(folder, target, *, aux=(0, 3), num_layers=2, block_size=4, rank=16, vocab_ids=None,
                                 seed=0, dtype=torch.float32, d2t_offsets=True):  # fmt: skip
    """A speculators DSpark checkpoint for `target` (its text config as `transformer_layer_config`)."""
    text = target.config.get_text_config()
    layer = text.to_dict()
    for key in ("_name_or_path", "transformers_version", "architectures"):
        layer.pop(key, None)
    layer.update(num_hidden_layers=num_layers, layer_types=["full_attention"] * num_layers)
    vocab = text.vocab_size
    k = vocab if vocab_ids is None else len(vocab_ids)
    cfg = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": "0.5.0",
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/verifier", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": k,
        "block_size": block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(aux),
        "mask_token_id": vocab - 1,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    d, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    hd = getattr(text, "head_dim", None) or d // heads
    w = {"fc.weight": rnd(d, len(aux) * d), "hidden_norm.weight": 1 + rnd(d), "norm.weight": 1 + rnd(d)}
    for i in range(num_layers):
        p = f"layers.{i}."
        for name, shape in [
            ("self_attn.q_proj", (heads * hd, d)),
            ("self_attn.k_proj", (kv * hd, d)),
            ("self_attn.v_proj", (kv * hd, d)),
            ("self_attn.o_proj", (d, heads * hd)),
            ("mlp.gate_proj", (text.intermediate_size, d)),
            ("mlp.up_proj", (text.intermediate_size, d)),
            ("mlp.down_proj", (d, text.intermediate_size)),
        ]:
            w[p + name + ".weight"] = rnd(*shape)
        for name, n in [("self_attn.q_norm", hd), ("self_attn.k_norm", hd), ("input_layernorm", d)]:
            w[p + name + ".weight"] = 1 + rnd(n)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(d)
    w["markov_head.markov_w1.weight"] = rnd(vocab, rank, scale=1.0)
    w["markov_head.markov_w2.weight"] = rnd(k, rank)
    w["confidence_head.proj.weight"] = rnd(1, d + rank)
    w["confidence_head.proj.bias"] = rnd(1)
    head = target.get_output_embeddings().weight.detach()
    w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    w["lm_head.weight"] = head.clone() if vocab_ids is None else head[torch.tensor(vocab_ids)].clone()
    if vocab_ids is not None:
        ids = torch.tensor(vocab_ids)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
        w["d2t"] = ids - torch.arange(k) if d2t_offsets else ids
    os.makedirs(folder, exist_ok=True)
    save_file({n: (v.to(dtype) if v.is_floating_point() else v) for n, v in w.items()}, f"{folder}/model.safetensors")
    with open(f"{folder}/config.json", "w") as f:
        json.dump(cfg, f)
    return cfg


@pytest.fixture(scope="module")
def target():
    return make_target("llama", dtype=torch.float32, markov=True, rope_parameters=LLAMA3)


def test_speculators_import_matches_reference_and_generates_like_plain(tmp_path, target):
    write_speculators_checkpoint(tmp_path, target, aux=(0, 3))
    draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)  # detected by speculators_model_type
    c = draft.config
    assert c.target_layer_ids == [-1, 2]  # aux id a is the input of layer a: our layer a - 1 (-1 = embedding)
    assert c.rope_parameters["rope_type"] == "llama3" and c.sequential_head == "markov" and c.confidence_head
    assert c.target_name_or_path == "tiny/verifier"
    inputs = block_inputs(draft)
    for a, b in zip(ours(draft, *inputs), reference_forward(tmp_path, *inputs)):
        assert max_diff(a, b) <= REFERENCE_TOL
    prompt = torch.tensor([[5, 17, 2, 40, 33, 8]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft), plain)


@pytest.mark.parametrize("d2t_offsets", [True, False])
def test_speculators_draft_vocabulary_imports_as_a_subset(tmp_path, target, d2t_offsets):
    vocab_ids = sorted(torch.randperm(95, generator=torch.Generator().manual_seed(1))[:40].tolist() + [95])
    write_speculators_checkpoint(tmp_path, target, aux=(1, 3), vocab_ids=vocab_ids, d2t_offsets=d2t_offsets)
    draft = load_speculators_checkpoint(tmp_path, target=target)
    assert draft.draft_vocab_ids.tolist() == vocab_ids
    inputs = block_inputs(draft)
    feats, block, prev = inputs
    ref_logits, ref_base, ref_conf = reference_forward(tmp_path, *inputs)  # over the K draft-vocabulary ids
    with torch.no_grad():
        out = draft(feats, block, torch.arange(9, 13)[None], prev, restrict_vocab=True)
    assert (
        max_diff(out.logits.float(), ref_logits) <= REFERENCE_TOL
        and max_diff(out.confidence_logits.float(), ref_conf) <= REFERENCE_TOL
    )
    prompt = torch.tensor([[5, 17, 2, 40, 33, 8]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft), plain)


def test_speculators_export_round_trip_exact(tmp_path, target):
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=2, block_size=4, markov_rank=16,
                                         target_layer_ids=[-1, 2])  # fmt: skip
    randomize(draft, seed=0)
    draft.config.target_name_or_path = "org/my-target"
    export_speculators(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["speculators_config"]["algorithm"] == "dspark"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/my-target"
    assert cfg["aux_hidden_state_layer_ids"] == [0, 3] and cfg["sample_from_anchor"] is True
    assert cfg["transformer_layer_config"]["rope_parameters"] == draft.config.rope_parameters
    assert cfg["draft_vocab_size"] == draft.config.vocab_size and cfg["markov_head_type"] == "vanilla"
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert_export_round_trip(draft, loaded, tmp_path)
    prompt = torch.tensor([[5, 17, 2, 40, 33, 8]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=loaded), plain)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"sample_from_anchor": "no"}, "sample_from_anchor"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        ({"mask_token_id": None}, "mask_token_id"),
    ],
)
def test_unsupported_speculators_settings_are_refused(tmp_path, target, change, match):
    cfg = write_speculators_checkpoint(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=match):
        DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_gemma4_style_drafts_are_not_exported_to_speculators(tmp_path):
    draft = DSparkDraftModel.from_target(make_gemma4_target(), num_hidden_layers=1)
    with pytest.raises(ValueError, match="export_deepspec"):
        export_speculators(draft, tmp_path)


def test_cli_export_speculators(tmp_path, target):
    from dspark_hf.cli import main as cli_main

    target.save_pretrained(tmp_path / "target")
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, markov_rank=16)
    draft.save_pretrained(tmp_path / "draft")
    argv = ["export", str(tmp_path / "draft"), str(tmp_path / "out"), "--format", "speculators"]
    assert cli_main(argv + ["--target", str(tmp_path / "target"), "--dtype", "float32"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["dtype"] == "float32"
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "out", target=target)
    inputs = block_inputs(draft)
    assert max_diff(ours(draft, *inputs)[0], ours(loaded, *inputs)[0]) == 0.0


@pytest.mark.parametrize(
    "fields",
    [dict(layer_types=["sliding_attention"], sliding_window=8), dict(sample_from_anchor=False, sequential_head="none")],
)
def test_sliding_or_dflash_layout_drafts_are_not_exported_to_deepspec(tmp_path, target, fields):
    from dspark_hf import export_deepspec

    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, markov_rank=16, **fields)
    with pytest.raises(ValueError, match="export_speculators"):
        export_deepspec(draft, tmp_path)


# ------------------------------------------------------------------ sliding layers and the DFlash layout, without
# speculators installed (tests/model/test_speculators_reference.py checks both against speculators itself)
def _draft(target, seed=0, **fields):
    fields = {"num_hidden_layers": 2, "block_size": 4, "markov_rank": 16, **fields}
    draft = DSparkDraftModel.from_target(target, **fields)
    return randomize(draft.float(), seed=seed)


def test_old_checkpoint_without_sample_from_anchor_loads_in_the_dflash_layout(tmp_path, target):
    cfg = write_speculators_checkpoint(tmp_path, target, block_size=5)
    del cfg["sample_from_anchor"]
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 4  # block_size - 1: the DFlash layout
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="no sample_from_anchor .* says sample_from_anchor=false") as record:
        draft = load_speculators_checkpoint(tmp_path, target=target)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert draft.config.sample_from_anchor is False and draft.config.block_size == 4
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 3  # neither: refused
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no sample_from_anchor") as err:
        load_speculators_checkpoint(tmp_path, target=target)
    assert "\n" not in str(err.value)


def test_dflash_layout_drafts_from_the_slots_after_the_anchor(target):
    """A `sample_from_anchor=False` draft of γ tokens is the same network run over `[anchor, mask × γ]` whose
    slots 1..γ are kept: a `True` draft of γ + 1 slots with the same weights, fed that block."""
    flash = _draft(target, block_size=3, sample_from_anchor=False, sequential_head="gated")
    anchor = _draft(target, block_size=4, sequential_head="gated")
    anchor.load_state_dict(flash.state_dict())
    feats, block, prev = block_inputs(anchor)  # [anchor, mask × 3], positions T..T+3
    wide = ours(anchor, feats, block, torch.cat([prev[:, :1], prev[:, :-1]], dim=1))  # slot j reads token j - 1
    narrow = ours(flash, feats, block[:, :3], prev[:, :3])
    for a, b in zip(narrow, wide):
        assert max_diff(a, b[:, 1:]) <= REFERENCE_TOL  # fp32 rounding of a longer block


def test_sliding_layer_sees_the_window_before_the_anchor_and_its_block_causally(target):
    draft = _draft(target, layer_types=["sliding_attention"] * 2, sliding_window=3)
    feats, block, prev = block_inputs(draft, context_len=9)
    block[0, 1:] = torch.tensor([7, 8, 9])  # distinct slots, so a later slot could show in an earlier one
    base = ours(draft, feats, block, prev)[1]
    outside, inside = feats.clone(), feats.clone()
    outside[:, 5] += 1.0  # position 5 < anchor 9 - window 3: not seen
    inside[:, 6] += 1.0
    assert max_diff(ours(draft, outside, block, prev)[1], base) == 0.0
    assert max_diff(ours(draft, inside, block, prev)[1], base) > 1e-3
    later = block.clone()
    later[0, 3] = 11  # the last slot changes: earlier slots (causal) do not
    changed = ours(draft, feats, later, prev)[1]
    assert max_diff(changed[:, :3], base[:, :3]) == 0.0 and max_diff(changed[:, 3:], base[:, 3:]) > 1e-3
    # non-causal within the block: every slot sees the change
    bidirectional = _draft(
        target, layer_types=["sliding_attention"] * 2, sliding_window=3, sliding_window_non_causal=True
    )
    bidirectional.load_state_dict(draft.state_dict())
    assert (
        max_diff(ours(bidirectional, feats, later, prev)[1][:, :3], ours(bidirectional, feats, block, prev)[1][:, :3])
        > 1e-3
    )


def test_sliding_dflash_layout_draft_trains_every_parameter(target):
    """Training goes through the same masks: one backward reaches every parameter."""
    from dspark_hf.model.modeling import block_attention_mask

    draft = _draft(target, block_size=3, sample_from_anchor=False, layer_types=["sliding_attention", "full_attention"],
                   sliding_window=4).train()  # fmt: skip
    feats = torch.randn(1, 12, len(draft.config.target_layer_ids) * draft.config.hidden_size)
    anchors = torch.tensor([[3, 8]])
    positions = (anchors[0, :, None] + torch.arange(3)).reshape(1, -1)
    ids = torch.full((1, 6), draft.config.mask_token_id)
    ids[0, ::3] = torch.tensor([4, 9])
    out = draft(
        feats, ids, positions, torch.randint(0, 90, (1, 6)), attention_mask=block_attention_mask(anchors, 12, 3)
    )
    (out.logits.float().logsumexp(-1).sum() + out.confidence_logits.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())


def test_sliding_dflash_layout_draft_saves_and_loads_in_our_format(tmp_path, target):
    draft = _draft(target, block_size=3, sample_from_anchor=False, layer_types=["full_attention", "sliding_attention"],
                   sliding_window=5, sliding_window_non_causal=True)  # fmt: skip
    draft.save_pretrained(tmp_path)
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    c = loaded.config
    assert (c.sample_from_anchor, c.layer_types, c.sliding_window, c.sliding_window_non_causal) == (
        False, ["full_attention", "sliding_attention"], 5, True)  # fmt: skip
    inputs = block_inputs(draft, context_len=11)
    assert max_diff(ours(draft, *inputs)[0], ours(loaded, *inputs)[0]) == 0.0
