"""Every speculators-trained draft loads and drafts as speculators 0.9.0's own code does (issue 51).

speculators itself builds the drafts (tests/speculators_reference.py: its trainer's layer config, its
`from_training_args`, `save_pretrained`, its training forward on packed anchor blocks, its own heads for the
greedy drafts), for every variant: heads (DFlash, DSpark vanilla / gated / RNN / confidence without Markov) x
layer types (full; all sliding, causal within the block, the trainer's default; sliding non-causal beside a full
layer) x anchor layouts (`sample_from_anchor` true and false) x config (as written now, and without
`sample_from_anchor` as before speculators' #760). Each loads here and must give the same per-slot logits and
confidence logits (fp32, max |Δ| <= 1e-5), the same greedy draft from our drafting path, and `generate()` equal
to plain greedy. Negative controls (shifted aux ids, the wrong layout) must fail the same comparison.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_hf import load_speculators_checkpoint
from dspark_hf.decoding.caches import KVStore
from dspark_hf.decoding.drafting import SharedSampler, draft_block, ingest, sample_block
from dspark_hf.model.modeling import block_attention_mask
from speculators_reference import run_reference

from helpers import REFERENCE_TOL, make_target

LENGTH = 26  # tokens of the teacher-forced sequence
ANCHORS = [3, 7, 12, 18]  # packed blocks; each sees the context before it (some more, some less than the window)
WINDOW = 4
AUX = [1, 3, 5]  # speculators' aux ids: the input of verifier layer a (hidden_states[a])
BLOCK = 4  # speculators' block_size


def _variant(name, kind="dspark", head="vanilla", layers="full", anchor=True, old=False, **extra) -> dict:
    rank = 0 if head in ("none", "confidence") else 8
    return {
        "name": name,
        "kind": kind,
        "markov_rank": rank,
        "markov_head_type": head if rank else "vanilla",
        "confidence": kind == "dspark" and head != "none",
        "confidence_with_markov": bool(rank),
        "layers": layers,
        "non_causal": layers == "mixed",  # the mixed drafts' sliding layer is non-causal within the block
        "window": WINDOW,
        "sample_from_anchor": anchor,
        "old": old,
        "block_size": BLOCK,
        "aux": AUX,
        "seed": len(name) * 7 + sum(map(ord, name)),
        **extra,
    }


def _variants() -> list[dict]:
    out = []
    for layers in ("full", "sliding", "mixed"):
        for anchor, old in ((True, False), (False, False), (False, True)):
            layout = "anchor" if anchor else ("dflash-old" if old else "dflash")
            out.append(_variant(f"dflash-{layers}-{layout}", kind="dflash", head="none", layers=layers, anchor=anchor,
                                old=old))  # fmt: skip
            for head in ("vanilla", "gated", "rnn"):
                out.append(_variant(f"{head}-{layers}-{layout}", head=head, layers=layers, anchor=anchor, old=old))
    out.append(_variant("confidence-sliding-anchor", head="confidence", layers="sliding"))
    out.append(_variant("confidence-sliding-dflash", head="confidence", layers="sliding", anchor=False))
    return out


VARIANTS = _variants()
LOADABLE = [v["name"] for v in VARIANTS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny Qwen3 verifier, the inputs, and one folder per variant written and run by speculators."""
    root = tmp_path_factory.mktemp("speculators")
    target = make_target("qwen3", dtype=torch.float32, markov=True)
    target.save_pretrained(root / "verifier")
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, target.config.vocab_size - 1, (1, LENGTH), generator=gen)
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
    inputs = {"input_ids": input_ids, "anchors": torch.tensor(ANCHORS)}
    inputs.update({f"hidden_{a}": h.contiguous() for a, h in enumerate(hidden)})
    save_file(inputs, root / "inputs.safetensors")
    spec = {"verifier": str(root / "verifier"), "inputs": str(root / "inputs.safetensors"), "out": str(root),
            "variants": VARIANTS}  # fmt: skip
    (root / "spec.json").write_text(json.dumps(spec))
    try:
        run_reference(str(root / "spec.json"))
    except RuntimeError as err:
        if os.environ.get("DSPARK_REQUIRE_SPECULATORS") == "1" or "pip install" not in str(err):
            raise
        pytest.skip(f"speculators 0.9.0 could not be installed: {str(err).splitlines()[0]}")
    return {"root": root, "target": target, "inputs": inputs}


def _features(inputs, aux=AUX) -> torch.Tensor:
    return torch.cat([inputs[f"hidden_{a}"] for a in aux], dim=-1)


def _load(folder, target):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        draft = load_speculators_checkpoint(folder, target=target)
    return draft, [str(w.message) for w in caught if "sample_from_anchor" in str(w.message)]


def _teacher_forced(draft, inputs, features=None):
    """Our forward on the same packed blocks: `[anchor, mask × (γ-1)]`, teacher-forced previous tokens."""
    gamma = draft.config.block_size
    ids, anchors = inputs["input_ids"], torch.tensor(ANCHORS)
    block = torch.full((len(ANCHORS), gamma), draft.config.mask_token_id)
    block[:, 0] = ids[0, anchors]
    positions = anchors[:, None] + torch.arange(gamma)
    prev = ids[0, positions]  # the token before each drafted one: the anchor, then the ground truth
    with torch.no_grad():
        out = draft(
            _features(inputs) if features is None else features,
            block.reshape(1, -1),
            positions.reshape(1, -1),
            prev.reshape(1, -1),
            attention_mask=block_attention_mask(anchors[None], LENGTH, gamma),
        )
    conf = None if out.confidence_logits is None else out.confidence_logits.reshape(len(ANCHORS), gamma)
    return out.logits.reshape(len(ANCHORS), gamma, -1), conf


def _greedy(draft, inputs, guessed_path):
    """Our drafting path (the one generate() and the engine run): each anchor a row with its own context."""
    feats, ids = _features(inputs)[0], inputs["input_ids"][0]
    stores = [KVStore(LENGTH + BLOCK) for _ in ANCHORS]
    ingest(draft, stores, [feats[:a] for a in ANCHORS])
    anchors = ids[torch.tensor(ANCHORS)]
    hidden, base = draft_block(draft, stores, anchors)
    sampler = SharedSampler(None, anchors[:, None], do_sample=False)
    block = sample_block(draft, hidden, base, anchors, sampler, guessed_path=guessed_path)
    return block.tokens, block.confidence_logits


def _graph_step(draft, inputs):
    """The step `generate()` records in a CUDA graph (`padded_draft_step`: contexts padded to one capacity with
    random values that must be masked out), run eagerly: its greedy tokens."""
    from dspark_hf.decoding.draft_graphs import padded_draft_step

    feats, ids = _features(inputs)[0], inputs["input_ids"][0]
    stores = [KVStore(LENGTH + BLOCK) for _ in ANCHORS]
    ingest(draft, stores, [feats[:a] for a in ANCHORS])
    gen = torch.Generator().manual_seed(9)
    context = []
    for i in range(len(draft.layers)):
        pair = []
        for kv in (0, 1):
            first = stores[0].layer(i)[kv]
            buf = torch.randn((len(ANCHORS), first.shape[0], LENGTH, first.shape[2]), generator=gen)
            for r, store in enumerate(stores):
                buf[r, :, : len(store)] = store.layer(i)[kv]
            pair.append(buf)
        context.append(tuple(pair))
    temperatures = torch.tensor(draft.config.calibration_temperatures)
    block, _ = padded_draft_step(draft, context, torch.tensor(ANCHORS), ids[torch.tensor(ANCHORS)], temperatures)
    return block.tokens


def _gap(ours: torch.Tensor | None, ref: torch.Tensor | None, ref_first: int) -> float:
    """Max |Δ| between our slot k and the reference slot predicting the same token (`k + ref_first`)."""
    if ours is None or ref is None:
        return 0.0 if ours is None and ref is None else float("inf")
    ref = ref[:, ref_first:]
    n = min(ours.shape[1], ref.shape[1])
    return float((ours[:, :n].float() - ref[:, :n].float()).abs().max())


def _ref(reference, name):
    folder = reference["root"] / name
    variant = next(v for v in VARIANTS if v["name"] == name)
    return folder, variant, load_file(folder / "reference.safetensors")


@pytest.mark.parametrize("name", LOADABLE)
def test_speculators_draft_matches_speculators_forward_and_drafts(reference, name):
    folder, variant, ref = _ref(reference, name)
    target = reference["target"]
    draft, notes = _load(folder, target)
    c = draft.config
    first = 0 if variant["sample_from_anchor"] else 1
    assert c.sample_from_anchor is variant["sample_from_anchor"] and c.block_size == BLOCK - first
    assert len(notes) == (1 if variant["old"] else 0)  # the old layout is detected, with a one-line note
    assert c.target_layer_ids == [a - 1 for a in AUX]
    sliding = {"full": [], "sliding": [0, 1], "mixed": [0]}[variant["layers"]]
    assert [i for i in range(c.num_hidden_layers) if c.layer_type(i) == "sliding_attention"] == sliding
    logits, conf = _teacher_forced(draft, reference["inputs"])
    assert _gap(logits, ref["logits"], first) <= REFERENCE_TOL
    assert _gap(conf, ref.get("confidence"), first) <= REFERENCE_TOL
    for guessed in (False, True):
        tokens, greedy_conf = _greedy(draft, reference["inputs"], guessed)
        assert torch.equal(tokens, ref["tokens"])
        assert _gap(greedy_conf, ref.get("greedy_confidence"), 0) <= REFERENCE_TOL
    assert torch.equal(_graph_step(draft, reference["inputs"]), ref["tokens"])
    prompt = torch.tensor([[5, 17, 2, 40, 33, 8, 61, 12]])
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft), plain)


@pytest.mark.parametrize("name", ["gated-sliding-anchor", "vanilla-mixed-dflash", "dflash-sliding-dflash-old"])
def test_negative_controls_are_caught(reference, tmp_path, name):
    """The comparison has power: shifted aux ids, the wrong layout and sliding layers read as full each fail it."""
    folder, variant, ref = _ref(reference, name)
    target, inputs = reference["target"], reference["inputs"]
    first = 0 if variant["sample_from_anchor"] else 1
    draft, _ = _load(folder, target)
    shifted = _features(inputs, [a + 1 for a in AUX])  # the features one layer off
    assert _gap(_teacher_forced(draft, inputs, shifted)[0], ref["logits"], first) > 1e-2
    wrong = tmp_path / "wrong"
    shutil.copytree(folder, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["sample_from_anchor"] = not variant["sample_from_anchor"]  # e.g. the old layout read as the new one
    (wrong / "config.json").write_text(json.dumps(cfg))
    draft, _ = _load(wrong, target)
    assert _gap(_teacher_forced(draft, inputs)[0], ref["logits"], first) > 1e-2
    assert not torch.equal(_greedy(draft, inputs, False)[0][:, : BLOCK - 1], ref["tokens"][:, : BLOCK - 1])
    full = tmp_path / "full"  # the sliding layers read as full-attention ones (what a loader ignoring them does)
    shutil.copytree(folder, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["full_attention"] * 2
    (full / "config.json").write_text(json.dumps(cfg))
    draft, _ = _load(full, target)
    assert _gap(_teacher_forced(draft, inputs)[0], ref["logits"], first) > 1e-2


@pytest.mark.parametrize(
    "change, field",
    [
        ({"sample_from_anchor": None, "speculative_tokens": 2}, "sample_from_anchor"),  # neither B nor B - 1
        ({"sample_from_anchor": "yes"}, "sample_from_anchor"),
        ({"sliding_window": None}, "sliding_window"),
    ],
)
def test_uninterpretable_checkpoints_are_refused_in_one_line(reference, tmp_path, change, field):
    folder, _, _ = _ref(reference, "vanilla-sliding-anchor")
    shutil.copytree(folder, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    for key, value in change.items():
        if key == "speculative_tokens":
            cfg["speculators_config"]["proposal_methods"][0][key] = value
        elif key == "sliding_window":
            cfg["transformer_layer_config"]["use_sliding_window"] = False
        elif value is None:
            del cfg[key]
        else:
            cfg[key] = value
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field) as err:
        load_speculators_checkpoint(tmp_path / "d", target=reference["target"])
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- export
EXPORTS = {  # our drafts: (fields, the speculators_model_type they must be written as)
    "exp-markov-anchor-sliding": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW), "dspark"),
    "exp-none-anchor": (dict(sequential_head="none", confidence_head=False), "dspark"),  # zero Markov head
    "exp-none-dflash-sliding": (
        dict(sequential_head="none", confidence_head=False, sample_from_anchor=False,
             layer_types=["sliding_attention"] * 2, sliding_window=WINDOW, sliding_window_non_causal=True),
        "dflash",
    ),
    "exp-gated-dflash": (dict(sequential_head="gated", sample_from_anchor=False), "dspark"),
}  # fmt: skip


@pytest.fixture(scope="module")
def exported(reference):
    """Our drafts exported with `export_speculators`, then loaded and run by speculators' own code."""
    from dspark_hf import DSparkDraftModel, export_speculators

    from helpers import randomize

    root, target = reference["root"], reference["target"]
    drafts = {}
    for i, (name, (fields, _)) in enumerate(EXPORTS.items()):
        block = 3 if fields.get("sample_from_anchor") is False else 4
        draft = DSparkDraftModel.from_target(target, num_hidden_layers=2, block_size=block, markov_rank=8,
                                             target_layer_ids=[a - 1 for a in AUX], **fields)  # fmt: skip
        randomize(draft, seed=10 + i)
        draft.config.target_name_or_path = str(root / "verifier")  # speculators loads the verifier from it
        export_speculators(draft, root / name)
        drafts[name] = draft
    spec = {"verifier": str(root / "verifier"), "inputs": str(root / "inputs.safetensors"), "out": str(root),
            "variants": [{"name": name, "load": True} for name in EXPORTS]}  # fmt: skip
    (root / "spec-export.json").write_text(json.dumps(spec))
    run_reference(str(root / "spec-export.json"))
    return drafts


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_is_read_by_speculators_as_drafted_here(reference, exported, name):
    draft, kind = exported[name], EXPORTS[name][1]
    c = draft.config
    folder = reference["root"] / name
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["speculators_model_type"] == kind and cfg["sample_from_anchor"] is c.sample_from_anchor
    assert cfg["block_size"] == c.block_size + (0 if c.sample_from_anchor else 1)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == c.block_size
    assert cfg["transformer_layer_config"]["layer_types"] == [c.layer_type(i) for i in range(2)]
    ref = load_file(folder / "reference.safetensors")
    first = 0 if c.sample_from_anchor else 1
    logits, conf = _teacher_forced(draft, reference["inputs"])
    assert _gap(logits, ref["logits"], first) <= REFERENCE_TOL
    assert _gap(conf, ref.get("confidence"), first) <= REFERENCE_TOL
    assert torch.equal(_greedy(draft, reference["inputs"], False)[0], ref["tokens"])
    loaded, _ = _load(folder, reference["target"])  # and back: the same draft
    assert loaded.config.sequential_head == c.sequential_head and loaded.config.layer_types == c.layer_types
    assert loaded.config.sample_from_anchor is c.sample_from_anchor and loaded.config.block_size == c.block_size
    assert _gap(_teacher_forced(loaded, reference["inputs"])[0], logits, 0) == 0.0


@pytest.mark.parametrize("name", ["rnn-sliding-dflash-old", "gated-mixed-anchor"])
def test_batched_engine_with_speculators_drafts_equals_plain_greedy(reference, name):
    """The engine's rows (padded draft contexts of different lengths, longer than the window) stay exact."""
    from dspark_hf import DSparkEngine, SamplingParams

    target = reference["target"]
    draft, _ = _load(reference["root"] / name, target)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 95, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=3)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(prompts, outputs):
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == plain.tolist()
