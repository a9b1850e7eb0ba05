"""Training over a draft vocabulary subset (`--draft_vocab_size K`).

The restricted training forward must compute exactly the subset's columns of the full forward, gradients must
reach only the subset's rows of the sequential head's `W2`, and a draft trained this way must carry its subset
into `save_pretrained` and still decode exactly the target's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from dspark_hf import DSparkDraftModel
from dspark_hf.model.modeling import block_attention_mask
from dspark_hf.train import DataArguments, ModelArguments, PrepareDataArguments, TrainArguments, prepare_data, train
from dspark_hf.train.data import load_token_dataset
from dspark_hf.train.features import target_features, target_logits
from dspark_hf.train.losses import IGNORE_INDEX, acceptance_estimates, build_blocks, dspark_loss, position_weights
from dspark_hf.train.step import forward_blocks
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


def _subset_step(target, draft, subset, seq_len: int = 20):
    """The trainer's own micro-batch step on one fully supervised sequence (every valid anchor), and the
    blocks it trains, rebuilt independently."""
    import contextlib

    from dspark_hf.train.data import TokenDataset
    from dspark_hf.train.losses import valid_anchor_positions
    from dspark_hf.train.step import BlockStep

    torch.manual_seed(2)
    ids = torch.randint(0, target.config.vocab_size, (seq_len,))
    mask = torch.ones(seq_len, dtype=torch.bool)
    runner = BlockStep(
        target,
        draft.config,
        TrainArguments(output_dir="unused", ce_weight=0.1, l1_weight=0.9, bce_weight=1.0),
        contextlib.nullcontext,
        subset,
    )
    out, _ = runner(draft, TokenDataset([(ids.tolist(), mask.tolist())]), None, [(0, 0)], None)
    blocks = build_blocks(
        ids[None], mask[None], [valid_anchor_positions(mask)], draft.config.block_size, draft.config.mask_token_id
    )
    return out, ids, blocks


def _exact_and_renormalised_acceptance(target, draft, subset, ids, blocks):
    """`Σ_S min(q, p_full)` (what verification accepts with) and `Σ_S min(q, p_S / Σ_S p)` (the old label),
    per slot, with `p` from an independent full forward of the target (its own LM head over all V columns)."""
    feats = target_features(target, list(draft.config.target_layer_ids), ids[None], torch.ones_like(ids[None]))
    with torch.no_grad():
        out = forward_blocks(draft, feats.context, blocks, restrict_vocab=True)
        full = target(ids[None]).logits.double()  # [1, T, V]
    q = out.logits.double().softmax(-1)
    p_full = full.softmax(-1)[0, blocks.target_positions[0]][None]  # [1, S, V]
    p_sub = p_full[..., subset]
    exact = torch.minimum(q, p_sub).sum(-1)
    renormalised = torch.minimum(q, p_sub / p_sub.sum(-1, keepdim=True)).sum(-1)
    return exact, renormalised, out.confidence_logits, 1.0 - p_sub.sum(-1)


def test_subset_training_acceptance_is_the_full_vocabulary_acceptance():
    """With a subset, the trainer's per-slot acceptance (τ_est, accept@k, the confidence label) is
    `Σ_S min(q, p_full)`; the target renormalised over the subset (the old label) is a different number."""
    target = make_target("llama", seed=0, dtype=torch.float64)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4).double()
    subset = torch.tensor(sorted({1, *range(0, 96, 3)}))
    draft.set_draft_vocab(subset)
    out, ids, blocks = _subset_step(target, draft, subset)
    exact, renormalised, conf, outside = _exact_and_renormalised_acceptance(target, draft, subset, ids, blocks)
    valid = blocks.valid
    assert valid.sum() > 20 and outside[valid].min() > 0.05  # the target has real mass outside the subset

    torch.testing.assert_close(out.accept[valid].double(), exact[valid], rtol=0, atol=2e-6)
    # Negative control: the renormalised acceptance is not what the trainer reports (it overstates it).
    assert (renormalised[valid] - exact[valid]).min() > 1e-3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.accept[valid].double(), renormalised[valid], rtol=0, atol=2e-6)

    # accept@k and τ_est are the per-position means of the exact acceptance.
    gamma = draft.config.block_size
    slot = torch.arange(valid.shape[1]) % gamma
    est = acceptance_estimates(out.tv_sum, out.count)
    means = [float(exact[0][valid[0] & (slot == k)].mean()) for k in range(gamma)]
    for k in range(gamma):
        assert est[f"accept@{k + 1}"] == pytest.approx(means[k], abs=2e-6)
    survival = torch.tensor(means).cumprod(0)
    assert est["tau_est"] == pytest.approx(1.0 + float(survival.sum()), abs=1e-5)

    # The confidence head's label is the exact acceptance too (BCE against it, weighted as in the loss).
    w = position_weights(gamma).double().repeat(valid.shape[1] // gamma)[None] * valid

    def bce(label):
        terms = F.binary_cross_entropy_with_logits(conf.double(), label.clamp(0, 1), reduction="none")
        return (w * terms).sum() / w.sum()

    assert float(out.bce) == pytest.approx(float(bce(exact)), abs=1e-5)
    assert abs(float(out.bce) - float(bce(renormalised))) > 1e-3


def test_subset_l1_is_the_full_vocabulary_distance():
    """`dspark_loss` with the log-partition: L1 = ‖q − p_full‖₁ with q = 0 off the subset (checked against the
    dense computation over all V columns); without it, p is the softmax of the given logits (no subset)."""
    torch.manual_seed(0)
    vocab, subset = 12, torch.tensor([0, 2, 3, 7, 11])
    full_logits = torch.randn(1, 4, vocab, dtype=torch.float64)
    draft_logits = torch.randn(1, 4, subset.numel(), dtype=torch.float64)
    valid = torch.ones(1, 4, dtype=torch.bool)
    labels = torch.zeros(1, 4, dtype=torch.long)
    log_z = torch.logsumexp(full_logits, -1)
    out = dspark_loss(draft_logits, full_logits[..., subset], labels, valid, block_size=4, target_log_partition=log_z)
    q_dense = torch.zeros(1, 4, vocab, dtype=torch.float64)
    q_dense[..., subset] = draft_logits.softmax(-1)
    l1_dense = (q_dense - full_logits.softmax(-1)).abs().sum(-1)
    w = position_weights(4).double()[None]
    torch.testing.assert_close(out.l1.double(), (w * l1_dense).sum() / w.sum(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.tv_sum.double(), 0.5 * l1_dense[0], rtol=0, atol=1e-6)
    old = dspark_loss(draft_logits, full_logits[..., subset], labels, valid, block_size=4)
    assert (old.tv_sum.double() - 0.5 * l1_dense[0]).abs().max() > 1e-2  # renormalised: another number


def test_log_partition_is_computed_once_per_position_and_matches_the_full_head():
    from dspark_hf.train.features import target_log_partition

    target = make_target("llama", seed=0, dtype=torch.float64)
    final = torch.randn(2, 9, target.config.hidden_size, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 1, 2, 3, 8, 8], [4, 4, 4, 5, 0, 0, 1, 2]])
    calls = []
    head = target.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    try:
        got = target_log_partition(target, final, positions, chunk_size=3)
    finally:
        hook.remove()
    expected = torch.logsumexp(head(final), -1).gather(1, positions)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-10)
    assert sum(calls) == 5 + 5 and max(calls) <= 3  # distinct (row, position) pairs, in chunks
