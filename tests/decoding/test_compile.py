"""The draft step (backbone + sequential head + confidence scores) is graph-capturable: `torch.compile(...,
fullgraph=True)` traces it without a graph break, for every sequential head, greedy and sampling, with and
without a draft vocabulary subset, at static shapes (fixed γ, a fixed-length context, fixed R).

Sampling takes its `Exp(1)` noise as an input (a traced graph cannot hold a `torch.Generator`). The `eager`
backend is used: it runs the same Dynamo capture (which is what fails on a host sync or a Python
branch on tensor data) without spending minutes in code generation on a CPU. The compiled step must
reproduce the eager one (greedy tokens equal; sampling equal with the same generator seed).
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf.decoding import drafting

from helpers import make_aligned_draft, make_target

VOCAB = 96
GAMMA = 4
ROWS = 2
CONTEXT = 6


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, markov=True, dtype=torch.float32)


def _step(draft, temperatures, do_sample: bool):
    def step(context_kv, block_ids, positions, seed_ids, noise=None):
        hidden = draft.run_backbone(draft.embed_tokens(block_ids), positions, context_kv)
        base = draft.draft_logits(hidden)
        sampler = drafting.SharedSampler(None, seed_ids, do_sample, noise=noise)
        block = drafting.sample_block(draft, hidden, base, block_ids[:, 0], sampler, guessed_path=False)
        scores = drafting.score_block(block, temperatures)
        return block.tokens, block.logits, scores.survival

    return step


def _inputs(draft):
    gen = torch.Generator().manual_seed(0)
    kv_heads = draft.config.num_key_value_heads
    head_dim = draft.config.head_dim
    context_kv = [
        (
            torch.randn(ROWS, kv_heads, CONTEXT, head_dim, generator=gen),
            torch.randn(ROWS, kv_heads, CONTEXT, head_dim, generator=gen),
        )
        for _ in draft.layers
    ]
    block = torch.full((ROWS, GAMMA), draft.config.mask_token_id)
    block[:, 0] = torch.tensor([3, 7])
    positions = (torch.arange(GAMMA) + CONTEXT)[None].expand(ROWS, GAMMA)
    return context_kv, block, positions, block[:, :1]


@pytest.mark.slow
@pytest.mark.parametrize("subset", [False, True], ids=["full", "subset"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_draft_step_compiles_without_graph_breaks(target, head, do_sample, subset):
    torch._dynamo.reset()
    draft = make_aligned_draft(target, head, block_size=GAMMA).float()
    if subset:
        draft.set_draft_vocab(list(range(0, VOCAB, 2)))
    assert draft.confidence_head is not None
    temperatures = torch.tensor(draft.config.calibration_temperatures)
    step = _step(draft, temperatures, do_sample)
    args = _inputs(draft)
    noise = None
    if do_sample:
        noise = torch.empty(ROWS, GAMMA, VOCAB, dtype=torch.float64).exponential_(
            generator=torch.Generator().manual_seed(1)
        )
    with torch.no_grad():
        eager = step(*args, noise=noise)
        compiled = torch.compile(step, fullgraph=True, backend="eager")
        traced = compiled(*args, noise=noise)
    assert torch.equal(eager[0], traced[0])
    torch.testing.assert_close(eager[1], traced[1])
    torch.testing.assert_close(eager[2], traced[2])
    if subset:  # the subset really restricted the draws
        assert set(traced[0].flatten().tolist()) <= set(range(0, VOCAB, 2))


def test_a_python_branch_on_tensor_data_breaks_the_capture(target):
    """Negative control: the same capture fails once the step branches on device data, as the old subset
    fallback did (`if not torch.isfinite(logits).any(): ...`)."""
    torch._dynamo.reset()
    draft = make_aligned_draft(target, "markov", block_size=GAMMA).float()
    temperatures = torch.tensor(draft.config.calibration_temperatures)
    inner = _step(draft, temperatures, False)

    def step(*args):
        tokens, logits, survival = inner(*args)
        if not torch.isfinite(logits).any():
            survival = survival * 0
        return tokens, logits, survival

    with torch.no_grad(), pytest.raises(Exception):  # noqa: B017 - dynamo raises its own error types
        torch.compile(step, fullgraph=True, backend="eager")(*_inputs(draft))
