"""The draft model itself: inference path == teacher-forced path, cache increments, training step."""

from __future__ import annotations

import pytest
import torch

from dspark_hf import DSparkDraftModel
from dspark_hf.decoding.caches import KVStore
from dspark_hf.model.modeling import block_attention_mask

from helpers import make_target


def _draft(head="markov", **kw):
    target = make_target("qwen3")
    torch.manual_seed(3)
    draft = DSparkDraftModel.from_target(target, sequential_head=head, markov_rank=16, num_hidden_layers=2, **kw)
    with torch.no_grad():  # non-trivial norms and biases so every path matters
        for _name, p in draft.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return target, draft


def _inference_block(draft, feats, anchor_pos, block_ids, prev_ids):
    """The path generate() takes: cache the context, run one block, then the sequential loop step by step."""
    cache = KVStore(anchor_pos)
    ctx = draft.project_context(feats[:, :anchor_pos])
    draft.extend_context([(cache, anchor_pos)], ctx, torch.arange(anchor_pos)[None])
    positions = torch.arange(anchor_pos, anchor_pos + draft.config.block_size)[None]
    context_kv = [tuple(t[None] for t in cache.layer(i)) for i in range(len(draft.layers))]
    hidden = draft.run_backbone(draft.embed_tokens(block_ids), positions, context_kv)
    base = draft.lm_head(hidden)[0]
    head, logits, confs = draft.markov_head, [], []
    state = head.init_state(1, hidden[0]) if head is not None else None
    for k in range(draft.config.block_size):
        h = hidden[0, k : k + 1]
        e = head.embed(prev_ids[:, k]) if head is not None else None
        step = base[k : k + 1]
        if head is not None:
            bias, state = head.step(h, e, state)
            step = step + bias
        logits.append(step)
        confs.append(draft.confidence_head(h, e))
    return torch.cat(logits), torch.cat(confs)


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_inference_path_matches_packed_training_forward(head):
    target, draft = _draft(head)
    c = draft.config
    gamma, ctx_len = c.block_size, 14
    torch.manual_seed(0)
    feats = torch.randn(1, ctx_len, c.num_target_features * c.hidden_size, dtype=draft.dtype)
    anchors = torch.tensor([[5, 11]])
    tokens = torch.randint(0, c.vocab_size, (1, 2 * gamma + 1))
    block_ids = torch.full((1, 2 * gamma), c.mask_token_id)
    block_ids[0, 0], block_ids[0, gamma] = tokens[0, 0], tokens[0, gamma]
    prev_ids = tokens[:, : 2 * gamma]
    positions = (anchors[:, :, None] + torch.arange(gamma)).reshape(1, -1)
    with torch.no_grad():
        out = draft(
            feats,
            block_ids,
            positions,
            prev_token_ids=prev_ids,
            attention_mask=block_attention_mask(anchors, ctx_len, gamma),
        )
        for j in range(2):
            sl = slice(j * gamma, (j + 1) * gamma)
            logits, confs = _inference_block(draft, feats, int(anchors[0, j]), block_ids[:, sl], prev_ids[:, sl])
            torch.testing.assert_close(out.logits[0, sl], logits, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(out.confidence_logits[0, sl], confs, atol=1e-10, rtol=1e-10)


def test_block_attention_mask_pattern():
    mask = block_attention_mask(torch.tensor([[2, 4]]), context_length=5, block_size=2)[0, 0]
    expected = torch.tensor(
        [
            # ctx 0..4        block0  block1
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_cache_grows_incrementally_like_one_shot():
    target, draft = _draft()
    feats = torch.randn(1, 9, draft.fc.in_features, dtype=draft.dtype)
    ctx = draft.project_context(feats)
    one, parts = KVStore(9), KVStore(9)
    draft.extend_context([(one, 9)], ctx, torch.arange(9)[None])
    for lo, hi in [(0, 4), (4, 5), (5, 9)]:
        draft.extend_context([(parts, hi - lo)], ctx[:, lo:hi], torch.arange(lo, hi)[None])
    assert len(one) == len(parts) == 9
    for i in range(2):
        for a, b in zip(one.layer(i), parts.layer(i)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_one_step_changes_every_trainable_parameter(head):
    target, draft = _draft(head)
    draft.train()
    embed_before = target.get_input_embeddings().weight.detach().clone()
    head_before = target.lm_head.weight.detach().clone()
    names = {n for n, _ in draft.named_parameters()}
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names), names
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    c = draft.config
    gamma = c.block_size
    feats = torch.randn(1, 12, draft.fc.in_features, dtype=draft.dtype)
    anchors = torch.tensor([[4, 8]])
    labels = torch.randint(0, c.vocab_size, (1, 2 * gamma))
    block_ids = torch.full((1, 2 * gamma), c.mask_token_id)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    out = draft(
        feats,
        block_ids,
        (anchors[:, :, None] + torch.arange(gamma)).reshape(1, -1),
        prev_token_ids=labels,
        attention_mask=block_attention_mask(anchors, 12, gamma),
    )
    loss = torch.nn.functional.cross_entropy(out.logits[0], labels[0])
    loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(
        out.confidence_logits, torch.rand_like(out.confidence_logits)
    )
    loss.backward()
    optimizer.step()
    unchanged = [n for n, p in draft.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, f"parameters not updated by one step: {unchanged}"
    assert torch.equal(target.get_input_embeddings().weight, embed_before)
    assert torch.equal(target.lm_head.weight, head_before)
