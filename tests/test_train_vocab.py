"""Training over a draft vocabulary subset (`--draft_vocab_size K`).

The restricted training forward must compute exactly the subset's columns of the full forward, gradients must
reach only the subset's rows of the sequential head's `W2`, and a draft trained this way must carry its subset
into `save_pretrained` and still decode exactly the target's output.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from dspark_hf import DSparkDraftModel
from dspark_hf.model.modeling import block_attention_mask
from dspark_hf.train import DataArguments, ModelArguments, PrepareDataArguments, TrainArguments, prepare_data, train
from dspark_hf.train.data import load_token_dataset
from dspark_hf.train.features import target_features, target_logits
from dspark_hf.train.losses import IGNORE_INDEX, build_blocks, dspark_loss
from train_helpers import make_char_tokenizer, make_chat_target

from helpers import make_target

HEADS = ["markov", "gated", "rnn", "none"]


def _batch(target, draft, seq_len: int = 24, anchors=(2, 9, 15)):
    torch.manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, seq_len))
    mask = torch.ones_like(ids, dtype=torch.bool)
    feats = target_features(target, list(draft.config.target_layer_ids), ids, torch.ones_like(ids))
    blocks = build_blocks(ids, mask, [torch.tensor(anchors)], draft.config.block_size, draft.config.mask_token_id)
    kwargs = dict(
        target_hidden_states=feats.context,
        input_ids=blocks.input_ids,
        position_ids=blocks.position_ids,
        prev_token_ids=blocks.prev_token_ids,
        attention_mask=block_attention_mask(blocks.anchors, seq_len, draft.config.block_size),
    )
    return kwargs, feats, blocks


@pytest.mark.parametrize("head", HEADS)
def test_restricted_forward_is_the_subset_columns_of_the_full_forward(head):
    target = make_target("llama", seed=0, dtype=torch.float64)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, sequential_head=head, num_hidden_layers=1, block_size=4).double()
    subset = torch.tensor([1, 3, 4, 10, 20, 50, 77, 95])
    draft.set_draft_vocab(subset)
    kwargs, _, _ = _batch(target, draft)
    full = draft(**kwargs)
    part = draft(**kwargs, restrict_vocab=True)
    assert part.logits.shape[-1] == subset.numel()
    torch.testing.assert_close(part.logits, full.logits[..., subset], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.base_logits, full.base_logits[..., subset], rtol=0, atol=1e-12)
    if draft.confidence_head is not None:
        torch.testing.assert_close(part.confidence_logits, full.confidence_logits, rtol=0, atol=0)
    if draft.markov_head is not None:  # gradients reach exactly the subset's rows of W2
        part.logits.square().sum().backward()
        grad = draft.markov_head.markov_w2.weight.grad
        outside = torch.ones(grad.shape[0], dtype=torch.bool)
        outside[subset] = False
        assert grad[subset].abs().sum() > 0 and grad[outside].abs().sum() == 0


def test_restrict_vocab_without_a_subset_is_refused():
    target = make_target("llama", seed=0)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4)
    kwargs, _, _ = _batch(target, draft)
    with pytest.raises(ValueError, match="set_draft_vocab"):
        draft(**kwargs, restrict_vocab=True)


def test_subset_loss_ignores_labels_outside_the_subset():
    target = make_target("llama", seed=0, dtype=torch.float64)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4).double()
    subset = torch.arange(0, 96, 2)  # even ids only
    draft.set_draft_vocab(subset)
    kwargs, feats, blocks = _batch(target, draft)
    out = draft(**kwargs, restrict_vocab=True)
    index = torch.full((96,), IGNORE_INDEX)
    index[subset] = torch.arange(subset.numel())
    labels = index[blocks.labels]
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()
    t_logits = target_logits(target, feats.final, blocks.target_positions, subset)
    loss = dspark_loss(out.logits, t_logits, labels, blocks.valid, out.confidence_logits, block_size=4)
    assert torch.isfinite(loss.loss)
    # CE by hand over the slots whose label is in the subset
    keep = blocks.valid & (labels != IGNORE_INDEX)
    w = torch.exp(-torch.arange(4, dtype=torch.float64) / 4.0).repeat(labels.shape[1] // 4)[None] * blocks.valid
    ce = torch.nn.functional.cross_entropy(out.logits[keep].float(), labels[keep], reduction="none")
    expected = (w[keep].float() * ce).sum() / w.sum().float()
    torch.testing.assert_close(loss.ce.float(), expected, rtol=1e-5, atol=1e-6)


def test_training_on_a_subset_saves_it_and_stays_lossless(tmp_path):
    target, tok = make_chat_target(), make_char_tokenizer()
    path = prepare_data(
        PrepareDataArguments(
            output=str(tmp_path / "data.jsonl"), max_new_tokens=40, batch_size=8, device="cpu", progress=False
        ),
        target=target,
        tokenizer=tok,
        prompts=[f"prompt {i}" for i in range(16)],
    )
    data = load_token_dataset(path)
    res = train(
        ModelArguments(num_hidden_layers=1, block_size=4, markov_rank=16, draft_vocab_size=24),
        DataArguments(num_anchors=16, eval_ratio=0.25),
        TrainArguments(
            output_dir=str(tmp_path / "run"), max_steps=6, per_device_batch_size=2, report_to="none", progress=False
        ),
        target=target,
        train_dataset=data,
    )
    saved = DSparkDraftModel.from_pretrained(str(tmp_path / "run"), target=target).eval()
    ids = saved.draft_vocab_ids
    assert ids is not None and ids.numel() == 24 and saved.config.draft_vocab_size == 24
    assert 1 in ids.tolist()  # the EOS / end-of-turn token is always in the subset
    torch.testing.assert_close(ids, res.model.draft_vocab_ids)
    config = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=1)
    for i in range(4):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"held out {i}"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            plain = target.generate(prompt, generation_config=config)
            spec = target.generate(prompt, generation_config=config, assistant_model=saved)
        assert torch.equal(plain, spec)
