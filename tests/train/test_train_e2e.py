"""End to end on a tiny target: prepare data → train → save → load → lossless generate(); cache vs online;
the DFlash baseline; only the draft's parameters train."""

from __future__ import annotations

import copy
import json
import runpy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark_hf import DSparkDraftModel, last_generation_stats
from dspark_hf.cli import main as cli_main
from dspark_hf.train import DataArguments, ModelArguments, TrainArguments, load_token_dataset, train
from dspark_hf.train import features as features_mod
from train_helpers import make_char_tokenizer, make_chat_target, write_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target + tokenizer saved to disk (the CLI loads them by path) and data prepared from it."""
    root = tmp_path_factory.mktemp("tiny")
    target, tok = make_chat_target(), make_char_tokenizer()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    prompts = write_prompts(root / "prompts.jsonl")
    data = root / "data.jsonl"
    rc = cli_main(
        [
            "prepare-data",
            "--prompts",
            prompts,
            "--output",
            str(data),
            "--target",
            str(root / "target"),
            "--max_new_tokens",
            "32",
            "--batch_size",
            "4",
            "--temperature",
            "1.0",
            "--top_k",
            "0",
            "--device",
            "cpu",
            "--no_progress",
        ]
    )
    assert rc == 0
    return root, data


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_prepare_train_save_load_generate_lossless(tiny, tmp_path):
    root, data = tiny
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model:\n  num_hidden_layers: 1\n  block_size: 4\n  markov_rank: 16\n"
        "data:\n  num_anchors: 16\n  eval_ratio: 0.25\n"
        "training:\n  max_steps: 4\n  learning_rate: 0.01\n  save_steps: 2\n  eval_steps: 2\n"
    )
    out = tmp_path / "draft"
    rc = cli_main(
        [
            "train",
            "--config",
            str(cfg),
            "--target",
            str(root / "target"),
            "--train_data",
            str(data),
            "--output_dir",
            str(out),
            "--no_progress",
        ]
    )
    assert rc == 0
    files = _files(out)
    # Online mode: weights, checkpoints, logs; no per-token feature cache anywhere.
    assert {"config.json", "model.safetensors", "metrics.jsonl", "eval_results.json"} <= set(files)
    assert "checkpoint-2/optimizer.safetensors" in files and not any("shard-" in f for f in files)
    assert any(f.startswith("tensorboard/") and "events" in f for f in files)
    big = [f for f in files if (out / f).stat().st_size > 1_000_000]
    assert not big, big
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [1, 2, 3, 4]
    evals = [x for x in lines if x["split"] == "eval"]
    assert [x["step"] for x in evals] == [2, 4] and all(1.0 <= x["tau_est"] <= 5.0 for x in evals)
    assert set(evals[0]) >= {"accept@1", "accept@4", "loss", "ce", "l1", "bce"}

    target = AutoModelForCausalLM.from_pretrained(root / "target")
    tok = make_char_tokenizer()
    draft = DSparkDraftModel.from_pretrained(out, target=target).eval()
    assert draft.config.block_size == 4 and draft.config.sequential_head == "markov"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "new prompt"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=1)
    assert torch.equal(target.generate(ids, assistant_model=draft, **kw), target.generate(ids, **kw))
    assert last_generation_stats(draft).num_rounds > 0


def _train_tiny(tmp_path, name, model_args, target, ds, feature_cache=None):
    """Three steps on the tiny data (a quarter held out), written to `tmp_path / name`."""
    return train(
        model_args,
        DataArguments(num_anchors=16, eval_ratio=0.25, feature_cache=feature_cache),
        TrainArguments(
            output_dir=str(tmp_path / name), max_steps=3, learning_rate=0.01, report_to="none", progress=False
        ),
        target=target,
        train_dataset=ds,
    )


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_feature_cache_gives_the_same_training_as_online(tiny, tmp_path, monkeypatch):
    _, data = tiny
    target = make_chat_target()
    ds = load_token_dataset(str(data))
    model_args = ModelArguments(num_hidden_layers=1, block_size=4, markov_rank=16)
    online = _train_tiny(tmp_path, "online", model_args, target, ds)
    cache_root = tmp_path / "cache"
    cached = _train_tiny(tmp_path, "cached", model_args, target, ds, str(cache_root))
    losses = lambda d: [(x["step"], x["loss"], x.get("tau_est")) for x in _metrics(tmp_path / d)]  # noqa: E731
    assert losses("online") == losses("cached")
    assert online.eval_metrics == cached.eval_metrics
    shards = sorted(p.name for p in cache_root.rglob("*.safetensors"))
    assert len(shards) == 2 and len(list(cache_root.rglob("index.json"))) == 2  # train and held-out sets

    # A second run reuses the cache: the target is never run for features again.
    def boom(*a, **kw):
        raise AssertionError("target features recomputed although cached")

    monkeypatch.setattr(features_mod, "target_features", boom)
    again = _train_tiny(tmp_path, "again", model_args, target, ds, str(cache_root))
    assert again.eval_metrics == cached.eval_metrics


def test_a_feature_cache_stores_the_log_partition_so_a_subset_run_never_computes_it(tiny, tmp_path, monkeypatch):
    """Over a draft vocabulary subset the label needs the full vocabulary's log-partition at each trained
    position: a cached run reads it from the cache (computed once per token at build time) and trains as the
    online run does, up to float rounding (the cache computes it in other groups of rows)."""
    _, data = tiny
    target = make_chat_target()
    ds = load_token_dataset(str(data))
    model_args = ModelArguments(num_hidden_layers=1, block_size=4, markov_rank=16, draft_vocab_size=24)
    online = _train_tiny(tmp_path, "online", model_args, target, ds)
    cache_root = tmp_path / "cache"
    real = features_mod.target_log_partition
    features_mod.FeatureCache.build(target, ds, list(online.model.config.target_layer_ids), cache_root, progress=False)
    stored = features_mod.FeatureCache(next(cache_root.iterdir()))
    for i in range(len(stored)):
        _, final, log_z = stored.get(i)
        everywhere = torch.arange(final.shape[0])[None]
        torch.testing.assert_close(log_z, real(target, final[None], everywhere)[0], rtol=0, atol=1e-5)

    def boom(*a, **kw):
        raise AssertionError("the full-vocabulary log-partition was recomputed although cached")

    monkeypatch.setattr(features_mod, "target_log_partition", boom)
    cached = _train_tiny(tmp_path, "cached", model_args, target, ds, str(cache_root))
    online_losses, cached_losses = _metrics(tmp_path / "online"), _metrics(tmp_path / "cached")
    assert [x["step"] for x in online_losses] == [x["step"] for x in cached_losses]
    for a, b in zip(online_losses, cached_losses):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    for key, value in online.eval_metrics.items():
        assert cached.eval_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_dflash_baseline_and_only_draft_parameters_train(tiny, tmp_path):
    _, data = tiny
    target = make_chat_target()
    embed, head = target.get_input_embeddings().weight.clone(), target.lm_head.weight.clone()
    torch.manual_seed(0)
    start = DSparkDraftModel.from_target(
        target, num_hidden_layers=1, block_size=4, sequential_head="none", confidence_head=False
    )
    start.save_pretrained(tmp_path / "start")
    result = train(
        ModelArguments(init_from=str(tmp_path / "start"), preset="dflash"),
        DataArguments(train_data=str(data), num_anchors=16, eval_ratio=0.0),
        TrainArguments(
            output_dir=str(tmp_path / "dflash"),
            max_steps=1,
            learning_rate=0.01,
            report_to="none",
            progress=False,
            mixed_precision="bf16",
        ),
        target=target,
    )
    trained = result.model
    assert trained.markov_head is None and trained.confidence_head is None
    unchanged = [n for n, p in trained.named_parameters() if torch.equal(p, start.state_dict()[n])]
    assert not unchanged, f"not updated by one step: {unchanged}"
    assert torch.equal(target.get_input_embeddings().weight, embed) and torch.equal(target.lm_head.weight, head)
    (line,) = [json.loads(x) for x in (tmp_path / "dflash" / "metrics.jsonl").read_text().splitlines()]
    assert line["loss"] == pytest.approx(line["ce"]) and line["bce"] == 0.0  # CE only


def test_training_from_a_calibrated_draft_saves_it_uncalibrated(tiny, tmp_path):
    """Training changes the confidences, so a draft resumed from calibrated weights must not keep the old
    temperatures (the hardware-aware policy would trust them): it is saved uncalibrated."""
    _, data = tiny
    target = make_chat_target()
    torch.manual_seed(0)
    start = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, markov_rank=16)
    start.config.confidence_calibrated = True
    start.config.calibration_temperatures = [0.5, 0.7, 0.9, 1.1]
    start.save_pretrained(tmp_path / "start")
    train(
        ModelArguments(init_from=str(tmp_path / "start")),
        DataArguments(train_data=str(data), num_anchors=8, eval_ratio=0.0),
        TrainArguments(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none", progress=False),
        target=target,
    )
    saved = DSparkDraftModel.from_pretrained(str(tmp_path / "run"), target=target)
    assert saved.config.confidence_calibrated is False
    assert saved.config.calibration_temperatures == [1.0] * 4
    assert DSparkDraftModel.from_pretrained(str(tmp_path / "start"), target=target).config.confidence_calibrated


def test_example_train_tiny_runs(tmp_path, monkeypatch, capsys):
    example = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
    monkeypatch.setattr("sys.argv", [str(example), "--steps", "10", "--out", str(tmp_path)])
    runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    assert "tau_est" in out and "identical to plain generate(): yes" in out
    assert (tmp_path / "draft" / "model.safetensors").exists()


def test_building_a_feature_cache_keeps_no_autograd_graph(tiny, tmp_path, monkeypatch):
    """`FeatureCache.build` on a target whose weights still require grad (as `from_pretrained` returns it)
    must not record autograd graphs: each kept sequence's graph (its `[T, V]` logits among them) filled 24 GB
    before a 4,140-conversation cache was written. The spy sees what every feature pass would record."""
    _, data = tiny
    target = make_chat_target()
    assert any(p.requires_grad for p in target.parameters())
    ds = load_token_dataset(str(data))
    seen = []
    real = features_mod.target_features

    def spy(*args, **kwargs):
        feats = real(*args, **kwargs)
        seen.append(torch.is_grad_enabled() or feats.context.requires_grad)
        return feats

    monkeypatch.setattr(features_mod, "target_features", spy)
    features_mod.FeatureCache.build(target, ds, [0, 1], tmp_path / "cache", progress=False)
    assert len(seen) == len(ds) and not any(seen)


def test_growing_a_draft_keeps_its_predictions_then_trains_the_new_layer(tiny, tmp_path):
    """`add_layers` appends copies of the last layer with zeroed output projections: the grown draft predicts
    exactly what the draft it grew from predicts (the same logits and confidences), and training then moves
    the new layer (its output projections leave zero) and saves a draft with the extra layer that still
    generates losslessly."""
    from dspark_hf.train.surgery import grow_layers

    _, data = tiny
    target = make_chat_target()
    torch.manual_seed(0)
    start = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, markov_rank=16)
    start.save_pretrained(tmp_path / "start")
    gamma, d = 4, target.config.hidden_size
    inputs = dict(
        target_hidden_states=torch.randn(1, 6, start.config.num_target_features * d),
        input_ids=torch.tensor(
            [[5, start.config.mask_token_id, start.config.mask_token_id, start.config.mask_token_id]]
        ),
        position_ids=torch.arange(6, 6 + gamma)[None],
        prev_token_ids=torch.tensor([[5, 7, 8, 9]]),
    )
    before = start(**inputs)
    grown = grow_layers(DSparkDraftModel.from_pretrained(str(tmp_path / "start"), target=target), 1)
    assert len(grown.layers) == grown.config.num_hidden_layers == 2
    after = grown(**inputs)
    torch.testing.assert_close(after.logits, before.logits, rtol=0, atol=0)
    torch.testing.assert_close(after.confidence_logits, before.confidence_logits, rtol=0, atol=0)
    # a deliberately wrong growth (the copy keeps its output projections) changes the predictions: the check has power
    wrong = DSparkDraftModel.from_pretrained(str(tmp_path / "start"), target=target)
    wrong.layers.append(copy.deepcopy(wrong.layers[-1]))
    assert not torch.equal(wrong(**inputs).logits, before.logits)

    train(
        ModelArguments(init_from=str(tmp_path / "start"), add_layers=1),
        DataArguments(train_data=str(data), num_anchors=8, eval_ratio=0.0),
        TrainArguments(
            output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=0.01, report_to="none", progress=False
        ),
        target=target,
    )
    saved = DSparkDraftModel.from_pretrained(str(tmp_path / "run"), target=target)
    assert saved.config.num_hidden_layers == 2
    assert saved.layers[1].self_attn.o_proj.weight.abs().sum() > 0
    assert saved.layers[1].mlp.down_proj.weight.abs().sum() > 0
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=saved, **kw), target.generate(ids, **kw))


@pytest.mark.parametrize("kind", ["markov", "gated", "rnn"])
def test_a_dflash_draft_upgraded_with_heads_proposes_the_same_then_trains_them(tiny, tmp_path, kind):
    """`add_heads` gives a DFlash draft (no sequential or confidence head) DSpark's heads with the sequential
    head's output projection at zero: the upgraded draft's logits are exactly the DFlash draft's, for any previous
    tokens. Through `train()` (preset dspark) the heads train (W2 leaves zero), and the saved draft loads as a
    DSpark draft with the heads and still generates losslessly. A deliberately wrong upgrade (W2 left random)
    changes the logits: the identity check has power."""
    from dspark_hf.train.surgery import add_heads

    _, data = tiny
    target = make_chat_target()
    torch.manual_seed(0)
    start = DSparkDraftModel.from_target(
        target, num_hidden_layers=1, block_size=4, sequential_head="none", confidence_head=False
    )
    start.save_pretrained(tmp_path / "dflash")
    gamma, d = 4, target.config.hidden_size
    mask = start.config.mask_token_id
    inputs = dict(
        target_hidden_states=torch.randn(1, 6, start.config.num_target_features * d),
        input_ids=torch.tensor([[5, mask, mask, mask]]),
        position_ids=torch.arange(6, 6 + gamma)[None],
        prev_token_ids=torch.tensor([[5, 7, 8, 9]]),
    )
    before = start(**inputs).logits
    upgraded = add_heads(DSparkDraftModel.from_pretrained(str(tmp_path / "dflash"), target=target), kind, 16)
    assert upgraded.config.sequential_head == kind and upgraded.config.markov_rank == 16
    assert upgraded.markov_head is not None and upgraded.confidence_head is not None
    out = upgraded(**inputs)
    torch.testing.assert_close(out.logits, before, rtol=0, atol=0)
    assert out.confidence_logits is not None
    wrong = DSparkDraftModel.from_pretrained(str(tmp_path / "dflash"), target=target)
    add_heads(wrong, kind, 16)
    torch.nn.init.normal_(wrong.markov_head.markov_w2.weight, std=0.5)
    assert not torch.equal(wrong(**inputs).logits, before)
    with pytest.raises(ValueError, match="already has"):
        add_heads(upgraded)

    train(
        ModelArguments(init_from=str(tmp_path / "dflash"), add_heads=True, sequential_head=kind, markov_rank=16),
        DataArguments(train_data=str(data), num_anchors=8, eval_ratio=0.0),
        TrainArguments(
            output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=0.01, report_to="none", progress=False
        ),
        target=target,
    )
    saved = DSparkDraftModel.from_pretrained(str(tmp_path / "run"), target=target)
    assert saved.config.sequential_head == kind and saved.config.confidence_head
    assert saved.markov_head.markov_w2.weight.abs().sum() > 0
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=saved, **kw), target.generate(ids, **kw))


def test_add_heads_needs_a_draft_and_a_sequential_head():
    from dspark_hf.train.args import LoraArguments
    from dspark_hf.train.surgery import build_draft

    with pytest.raises(ValueError, match="init_from"):
        ModelArguments(add_heads=True)
    with pytest.raises(ValueError, match="sequential_head"):
        ModelArguments(init_from="x", add_heads=True, preset="dflash")
    with pytest.raises(ValueError, match="--lora"):
        build_draft(make_chat_target(), ModelArguments(init_from="x", add_heads=True), LoraArguments(lora=True))


def test_add_layers_needs_a_draft_to_grow():
    with pytest.raises(ValueError, match="init_from"):
        ModelArguments(add_layers=1)
    with pytest.raises(ValueError, match=">= 0"):
        ModelArguments(init_from="x", add_layers=-1)


def test_add_layers_is_refused_with_lora():
    from dspark_hf.train.args import LoraArguments
    from dspark_hf.train.surgery import build_draft

    with pytest.raises(ValueError, match="--lora"):
        build_draft(make_chat_target(), ModelArguments(init_from="x", add_layers=1), LoraArguments(lora=True))


@pytest.mark.parametrize("layers", [1, 2])
def test_a_fresh_draft_can_start_from_the_targets_top_layers(tiny, tmp_path, layers):
    """`init_layers_from_target`: draft layer i of n holds target layer L - n + i's projections and norms, and the
    draft's final norm the target's; the Qwen3-style q/k norms the target lacks keep their fresh values. Through
    `train()` the option reaches the model (a draft trained 1 step at learning rate 0 still holds the copy), and
    without it (the control) the layers are random."""
    from dspark_hf.train.surgery import build_draft, init_layers_from_target

    _, data = tiny
    target = make_chat_target()
    top = target.model.layers
    n_target = len(top)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=layers, block_size=4, markov_rank=16)
    fresh_q_norm = draft.layers[0].self_attn.q_norm.weight.clone()
    copied = init_layers_from_target(draft, target)
    for i in range(layers):
        source = top[n_target - layers + i]
        assert torch.equal(draft.layers[i].self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(draft.layers[i].mlp.down_proj.weight, source.mlp.down_proj.weight)
        assert torch.equal(draft.layers[i].input_layernorm.weight, source.input_layernorm.weight)
        assert f"layers.{i}.self_attn.o_proj.weight" in copied
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    assert torch.equal(draft.layers[0].self_attn.q_norm.weight, fresh_q_norm)
    assert not any("q_norm" in name or name.startswith(("fc.", "markov_head.")) for name in copied)

    from dspark_hf.train.args import LoraArguments

    for flag in (True, False):
        torch.manual_seed(0)
        built = build_draft(target, ModelArguments(num_hidden_layers=1, init_layers_from_target=flag), LoraArguments())
        same = torch.equal(built.layers[0].mlp.up_proj.weight, top[-1].mlp.up_proj.weight)
        assert same is flag
    train(
        ModelArguments(num_hidden_layers=1, block_size=4, markov_rank=16, init_layers_from_target=True),
        DataArguments(train_data=str(data), num_anchors=8, eval_ratio=0.0),
        TrainArguments(
            output_dir=str(tmp_path / "run"), max_steps=1, learning_rate=0.0, report_to="none", progress=False
        ),
        target=target,
    )
    saved = DSparkDraftModel.from_pretrained(str(tmp_path / "run"), target=target)
    assert torch.equal(saved.layers[0].self_attn.k_proj.weight, top[-1].self_attn.k_proj.weight)


def test_init_layers_from_target_is_for_fresh_drafts_and_needs_matching_shapes():
    from dspark_hf.train.surgery import init_layers_from_target

    with pytest.raises(ValueError, match="fresh draft"):
        ModelArguments(init_from="x", init_layers_from_target=True)
    target = make_chat_target()
    narrow = DSparkDraftModel.from_target(target, num_hidden_layers=1, intermediate_size=8)
    copied = init_layers_from_target(narrow, target)  # a narrower MLP: the attention is copied, the MLP is not
    assert "layers.0.self_attn.q_proj.weight" in copied and not any(".mlp." in name for name in copied)
    other = DSparkDraftModel.from_target(target, num_hidden_layers=1, intermediate_size=8, head_dim=4)
    with pytest.raises(ValueError, match="shaped differently"):
        init_layers_from_target(other, target)
