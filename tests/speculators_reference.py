"""speculators 0.9.0 itself as the reference for the speculators format (tests/model/test_speculators_reference.py).

vLLM's `speculators` library pins `transformers<=5.19`, which conflicts with the release this project is tested
with (constraints.txt), so it is not a dev dependency. Instead [`speculators_path`] installs it once, without its
dependencies, into a cached folder (`pip install --no-deps --target`, with the modules it imports that the dev
environment lacks: `hs-connectors`, `loguru`, `pydantic-settings`, `python-dotenv`), and [`run_reference`] runs this file as a script in a
subprocess with that folder on `PYTHONPATH` (speculators registers its own config classes, so it never shares a
process with dspark_hf's tests). The script builds each draft with speculators' own code — the trainer's
`create_transformer_layer_config` (which makes layers sliding unless listed in `full_attention_indices`),
`DSparkDraftModel` / `DFlashDraftModel.from_training_args`, `save_pretrained` — and runs its own training
forward on packed anchor blocks, capturing the per-slot logits and confidence logits that forward hands to its
loss, and the greedy draft of each block made with its own Markov and confidence heads.

The cache folder is `$DSPARK_SPECULATORS_DIR`, else `~/.cache/dspark_hf_tests/speculators-0.9.0`: outside the
user's `~/.cache/dspark_hf`, which the suite checks it never touches (tests/conftest.py). When it cannot be
installed (no network) the tests skip, unless `DSPARK_REQUIRE_SPECULATORS=1` makes that a failure (for CI, as
`DSPARK_REQUIRE_BROWSER=1` does for the browser test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# speculators and the modules it imports (on the path this reference takes) that `.[dev]` does not install; the rest
# of its declared dependencies (torch, transformers, datasets, ...) come from the test environment, --no-deps
SPECULATORS_PINS = (
    "speculators==0.9.0",
    "hs-connectors==0.9.0",
    "loguru==0.7.3",
    "pydantic-settings==2.14.1",
    "python-dotenv==1.2.2",
)


def speculators_path() -> str:
    """The folder holding speculators 0.9.0 (installed on first use, under a lock); raises `RuntimeError`."""
    import fcntl

    folder = os.environ.get("DSPARK_SPECULATORS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "dspark_hf_tests", "speculators-0.9.0"
    )
    done = os.path.join(folder, ".installed")
    if os.path.exists(done):
        return folder
    os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the two test workers install once
        if not os.path.exists(done):
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", folder]
            proc = subprocess.run([*cmd, *SPECULATORS_PINS], capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"`{' '.join(cmd)} {' '.join(SPECULATORS_PINS)}` failed:\n{proc.stderr[-2000:]}")
            open(done, "w").close()
    return folder


def run_reference(spec_file: str) -> None:
    """Run this file on `spec_file` with speculators importable; raises `RuntimeError` with its output."""
    env = {**os.environ, "PYTHONPATH": speculators_path(), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, spec_file], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"speculators reference failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


# ---------------------------------------------------------------------------------------- the subprocess side
def _build(variant: dict, verifier: str):
    """A draft made the way speculators' trainer makes one, with random (non-trivial) weights."""
    import torch
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config

    layers = variant["layers"]
    full = {"full": [0, 1], "sliding": [], "mixed": [1]}[layers]
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=2,
        draft_arch="qwen3",
        hidden_act=None,
        sliding_window=variant["window"],
        full_attention_indices=full,
    )
    kwargs = dict(
        verifier_name_or_path=verifier,
        draft_vocab_size=layer_config.vocab_size,
        block_size=variant["block_size"],
        mask_token_id=layer_config.vocab_size - 1,
        target_layer_ids=variant["aux"],
        sample_from_anchor=variant["sample_from_anchor"],
        sliding_window_non_causal=variant["non_causal"],
        draft_attn_impl="eager",
    )
    if variant["kind"] == "dspark":
        kwargs.update(
            markov_rank=variant["markov_rank"],
            markov_head_type=variant["markov_head_type"],
            enable_confidence_head=variant["confidence"],
            confidence_head_with_markov=variant["confidence_with_markov"],
        )
        model = DSparkDraftModel.from_training_args(verifier_config=layer_config, **kwargs)
    else:
        model = DFlashDraftModel.from_training_args(verifier_config=layer_config, **kwargs)
    gen = torch.Generator().manual_seed(variant["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[0] in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
                continue  # the verifier's (frozen) copies
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else (1.0 if "markov_w1" in name else 0.1) * noise)
    return model.float().eval()


def _load(folder: str):
    """speculators' `SpeculatorModel.from_pretrained` (its verifier weights from the config's verifier path),
    on the eager attention instead of the default flex attention."""
    from speculators import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(folder, config=config).float().eval()


def _forward(model, features, input_ids, anchors):
    """speculators' own training forward on the packed blocks at `anchors`: (base logits, logits, confidence
    logits, hidden states), each `[N, B, ...]`, captured where the forward hands them on."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    import torch

    seen = {}

    def anchors_fn(loss_mask, num_anchors, block_size):
        return anchors, torch.ones_like(anchors, dtype=torch.bool)

    def dflash_metrics(logits, *args, **kwargs):  # DFlash's compute_metrics(logits, targets, loss_mask, ...)
        seen["logits"] = logits
        return torch.zeros(()), {}

    def dspark_metrics(logits, targets, confidence_logits, *args, **kwargs):
        seen["confidence"] = confidence_logits
        return dflash_metrics(logits)

    backbone = model._backbone_forward

    def spy(*args, **kwargs):
        out = backbone(*args, **kwargs)
        seen["hidden"], seen["base"] = out[0], out[1]
        return out

    saved = dflash_core.select_anchors, dflash_core.compute_metrics, dspark_core.compute_metrics
    dflash_core.select_anchors = anchors_fn
    dflash_core.compute_metrics, dspark_core.compute_metrics = dflash_metrics, dspark_metrics
    model._backbone_forward = spy
    try:
        length = input_ids.shape[1]
        with torch.no_grad():
            model(
                hidden_states=features,
                input_ids=input_ids,
                loss_mask=torch.ones(1, length, dtype=torch.long),
                verifier_last_hidden_states=torch.zeros(1, length, model.config.transformer_layer_config.hidden_size),
                document_ids=torch.zeros(1, length, dtype=torch.long),
                max_anchors=len(anchors),
            )
    finally:
        dflash_core.select_anchors, dflash_core.compute_metrics, dspark_core.compute_metrics = saved
        del model._backbone_forward
    n, b = len(anchors), model.block_size
    conf = seen.get("confidence")
    return (
        seen["base"].reshape(n, b, -1),
        seen["logits"].reshape(n, b, -1),
        None if conf is None else conf.reshape(n, b),
        seen["hidden"].reshape(n, b, -1),
    )


def _greedy(model, base, hidden, anchor_tokens, first_slot: int):
    """The greedy draft of each block along speculators' own heads: the slot predicting `anchor + k` reads the
    token drafted before it (the anchor for the first) through the Markov head's `block_bias`, which runs the
    whole block (an RNN state passes through every slot). Returns tokens and confidence logits `[N, B - first]`."""
    import torch

    head, conf_head = getattr(model, "markov_head", None), getattr(model, "confidence_head", None)
    n, b = base.shape[:2]
    prev = anchor_tokens[:, None].repeat(1, b)  # slot s reads prev[:, s]; slots before first_slot read the anchor
    tokens, confs = [], []
    for slot in range(first_slot, b):
        logits = base[:, slot]
        if head is not None:
            logits = logits + head.block_bias(prev_token_ids=prev, hidden_states=hidden)[:, slot]
        if conf_head is not None:
            feats = hidden[:, slot]
            if model.config.confidence_head_with_markov and head is not None:
                feats = torch.cat([feats, head.prev_embeddings(prev[:, slot])], dim=-1)
            confs.append(conf_head(feats))
        token = logits.argmax(dim=-1)
        tokens.append(token)
        if slot + 1 < b:
            prev[:, slot + 1] = token
    conf = torch.stack(confs, dim=1) if confs else None
    return torch.stack(tokens, dim=1), conf


def main(spec_file: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    spec = json.load(open(spec_file))
    inputs = load_file(spec["inputs"])
    input_ids, anchors = inputs["input_ids"], inputs["anchors"]
    for variant in spec["variants"]:
        torch.manual_seed(0)
        folder = os.path.join(spec["out"], variant["name"])
        if variant.get("load"):  # a draft dspark_hf exported: loaded by speculators' own from_pretrained
            model = _load(folder)
        else:
            model = _build(variant, spec["verifier"])
            model.save_pretrained(folder)
        if variant.get("old"):  # written before speculators' #760: no sample_from_anchor key
            path = os.path.join(folder, "config.json")
            cfg = json.load(open(path))
            del cfg["sample_from_anchor"]
            json.dump(cfg, open(path, "w"), indent=2)
        # the verifier's hidden_states[a] for each aux id a (the input of its layer a, what vLLM captures)
        aux = model.config.aux_hidden_state_layer_ids
        feats = torch.cat([inputs[f"hidden_{a}"] for a in aux], dim=-1).float()
        base, logits, conf, hidden = _forward(model, feats, input_ids, anchors)
        first = 0 if model.config.sample_from_anchor else 1
        tokens, greedy_conf = _greedy(model, base, hidden, input_ids[0, anchors], first)
        out = {"logits": logits, "base": base, "tokens": tokens}
        if conf is not None:
            out.update(confidence=conf, greedy_confidence=greedy_conf)
        save_file({k: v.clone().contiguous() for k, v in out.items()}, os.path.join(folder, "reference.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
