"""LoRA domain adaptation: train an adapter on an existing draft, save only the adapter, load it for
generation, merge it, resume a LoRA run exactly."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_hf import DSparkDraftModel
from dspark_hf.model.modeling import block_attention_mask
from dspark_hf.train import (
    DataArguments,
    LoraArguments,
    ModelArguments,
    TrainArguments,
    load_draft_with_adapter,
    load_token_dataset,
    merge_adapter,
    train,
)
from train_helpers import make_char_tokenizer, make_chat_target, sampled_data

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    target, tok = make_chat_target(), make_char_tokenizer()
    data = sampled_data(root / "data.jsonl", target, tok, [f"domain prompt {i}" for i in range(8)])
    torch.manual_seed(0)
    base = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, markov_rank=16)
    base.save_pretrained(root / "base")
    return root, target, load_token_dataset(data)


def _lora_run(root, target, ds, out, callbacks=(), **train_kw):
    kw = dict(max_steps=4, learning_rate=0.02, save_steps=2, report_to="none", progress=False)
    kw.update(train_kw)
    return train(
        ModelArguments(init_from=str(root / "base")),
        DataArguments(num_anchors=12, eval_ratio=0.25),
        TrainArguments(output_dir=str(out), **kw),
        LoraArguments(lora=True, lora_r=4, lora_alpha=8),
        target=target,
        train_dataset=ds,
        callbacks=callbacks,
    )


def _logits(draft, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = draft.config
    feats = torch.randn(1, 10, c.num_target_features * c.hidden_size, generator=g)
    anchors = torch.tensor([[3, 7]])
    ids = torch.randint(0, c.vocab_size, (1, 2 * c.block_size), generator=g)
    pos = (anchors[:, :, None] + torch.arange(c.block_size)).reshape(1, -1)
    with torch.no_grad():
        out = draft(feats, ids, pos, prev_token_ids=ids, attention_mask=block_attention_mask(anchors, 10, c.block_size))
    return out.logits, out.confidence_logits


def test_lora_adapter_save_load_merge_round_trip(setup, tmp_path):
    root, target, ds = setup
    out = tmp_path / "adapter"
    _lora_run(root, target, ds, out)
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    assert (out / "adapter_model.safetensors").stat().st_size < (root / "base" / "model.safetensors").stat().st_size
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(root / "base")

    base = DSparkDraftModel.from_pretrained(root / "base", target=target).eval()
    adapted = load_draft_with_adapter(str(root / "base"), str(out), target=target)
    assert isinstance(adapted, DSparkDraftModel)
    base_logits, adapted_logits = _logits(base)[0], _logits(adapted)[0]
    assert not torch.allclose(base_logits, adapted_logits)  # the adapter changes the draft

    merged = merge_adapter(str(root / "base"), str(out), str(tmp_path / "merged"), target=target)
    for a, b in zip(_logits(adapted), _logits(merged)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "merged", target=target).eval()
    for a, b in zip(_logits(merged), _logits(reloaded)):
        assert torch.equal(a, b)
    assert not any("lora" in n for n, _ in reloaded.named_parameters())

    tok = make_char_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "new domain"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=1)
    plain = target.generate(ids, **kw)
    for draft in (adapted, merged, reloaded):
        assert torch.equal(target.generate(ids, assistant_model=draft, **kw), plain)


def test_lora_run_resumes_exactly(setup, tmp_path):
    root, target, ds = setup
    _lora_run(root, target, ds, tmp_path / "ref")

    def interrupt(state):
        if state.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _lora_run(root, target, ds, tmp_path / "run", callbacks=[interrupt])
    assert (tmp_path / "run" / "checkpoint-2" / "trainable.safetensors").exists()
    _lora_run(root, target, ds, tmp_path / "run", resume_from_checkpoint="auto")
    read = lambda d: [  # noqa: E731
        {k: v for k, v in json.loads(x).items() if not k.endswith("_per_s")}
        for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
    ]
    assert read("run") == read("ref")
