"""The example scripts that change weights or measure drafts (examples/default_drafts/), on tiny models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dspark_hf import DSparkDraftModel

from deepspec_reference import block_inputs, ours
from helpers import make_target, randomize

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "default_drafts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grow_rank_widens_the_markov_head_without_changing_what_the_draft_computes(tmp_path):
    grow_rank = _script("grow_rank")
    target = make_target(dtype=torch.float32)
    draft = randomize(DSparkDraftModel.from_target(target, sequential_head="markov", markov_rank=8).float())
    draft.save_pretrained(tmp_path / "r8")
    grow_rank.grow(tmp_path / "r8", tmp_path / "r24", rank=24)
    wide = DSparkDraftModel.from_pretrained(tmp_path / "r24", target=target).eval()
    assert wide.config.markov_rank == 24 and wide.markov_head.markov_w1.weight.shape[1] == 24
    # the new W1 columns are random, so the widened head has something to train from
    assert wide.markov_head.markov_w1.weight[:, 8:].abs().sum() > 0
    feats, block, prev = block_inputs(draft, seed=5)
    for before, after in zip(ours(draft, feats, block, prev), ours(wide, feats, block, prev)):
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    # a head whose new columns do count computes something else: the comparison above can fail
    with torch.no_grad():
        wide.markov_head.markov_w2.weight[:, 8:].normal_(0.0, 1.0)
    assert not torch.allclose(ours(wide, feats, block, prev)[0], ours(draft, feats, block, prev)[0], atol=1e-3)
    with pytest.raises(SystemExit, match="must exceed"):
        grow_rank.grow(tmp_path / "r8", tmp_path / "r4", rank=4)
    with pytest.raises(SystemExit, match="exists"):
        grow_rank.grow(tmp_path / "r8", tmp_path / "r24", rank=32)


def test_first_token_gap_scores_the_first_drafted_token_as_training_does():
    """The script's plain mean is training's accept@1 over the same anchors; its weights average about 1."""
    from dspark_hf.train.features import target_features, target_logits
    from dspark_hf.train.losses import build_blocks, dspark_loss, valid_anchor_positions
    from dspark_hf.train.step import forward_blocks

    gap = _script("first_token_gap")
    target = make_target(dtype=torch.float32)
    draft = randomize(DSparkDraftModel.from_target(target, sequential_head="markov", markov_rank=8).float())
    torch.manual_seed(0)
    dataset = []  # replies sampled from the target (the weights average 1 only under its distribution)
    for _ in range(8):
        prompt = torch.randint(0, target.config.vocab_size - 1, (1, 4))
        ids = target.generate(prompt, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=30, min_new_tokens=30)[0]
        dataset.append((ids, torch.arange(ids.numel()) >= 4))  # the 4-token prompt, then the reply
    rates = gap.first_token_rates({"draft": draft}, target, dataset)["draft"]
    tv_sum = count = 0.0
    for ids, mask in dataset:  # training's loss on the same anchors: every one that follows another
        anchors = valid_anchor_positions(mask)[1:]
        ids_, mask_ = ids[None], mask[None]
        feats = target_features(target, list(draft.config.target_layer_ids), ids_, torch.ones_like(ids_))
        blocks = build_blocks(ids_, mask_, [anchors], draft.config.block_size, draft.config.mask_token_id)
        with torch.no_grad():
            out = forward_blocks(draft, feats.context, blocks)
        loss = dspark_loss(
            out.logits,
            target_logits(target, feats.final, blocks.target_positions),
            blocks.labels,
            blocks.valid,
            block_size=draft.config.block_size,
        )
        tv_sum, count = tv_sum + float(loss.tv_sum[0]), count + float(loss.count[0])
    assert rates["anchors"] == count
    assert rates["plain"] == pytest.approx(1.0 - tv_sum / count, abs=1e-5)
    assert 0.0 < rates["after_rejection"] < 1.0 and rates["after_rejection"] != pytest.approx(rates["plain"])
    assert 0.5 < rates["mean_weight"] < 2.0


def test_round8_code_prompts_ask_as_humaneval_asks_and_stop_at_the_docstring(tmp_path):
    """Round 8's code prompts wrap a function's header and docstring exactly as the HumanEval set wraps a task."""
    import sys

    from dspark_hf.evaluation.prompt_sets import load_prompt_set

    round8 = _script("round8_data")
    task = load_prompt_set("humaneval", limit=1)[0]
    assert round8.CODE_REQUEST.format(task.reference["task"]["prompt"]) == task.prompt
    source = '''
def documented(a, b=2):
    """Add two numbers and say so at some length, long enough to keep."""
    return a + b


def bare(a):
    """A docstring with nothing after it is no function to complete."""


def short(a):
    """Too short."""
    return a


def _private(a):
    """Private helpers are left out however long their docstring is."""
    return a


class Box:
    def method(self, x):
        """A method, dedented to the left margin like a function would be."""
        return x
'''
    (tmp_path / "round8_probe.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        module = round8.quietly_import("round8_probe")
    finally:
        sys.path.remove(str(tmp_path))
    stubs = dict(round8.function_stubs(module, min_doc=40, max_doc=900))
    assert sorted(stubs) == ["documented", "method"]
    assert stubs["documented"] == (
        'def documented(a, b=2):\n    """Add two numbers and say so at some length, long enough to keep."""\n'
    )
    assert stubs["method"].startswith('def method(self, x):\n    """A method') and "return" not in stubs["method"]
    assert round8.quietly_import("antigravity") is None and round8.quietly_import("no_such_module_here") is None
