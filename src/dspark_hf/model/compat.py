"""Checks that a draft and a target belong together, run whenever they meet (binding, `generate()`)."""

from __future__ import annotations

import warnings
from typing import Any

from .configuration import DSparkConfig


def check_target_compatibility(config: DSparkConfig, target: Any) -> None:
    """Raise `ValueError` if `target` cannot host a draft with `config`; warn if it is not the recorded target.

    Checked: vocabulary size, hidden size, and that every `target_layer_ids` entry is a non-final layer of the
    target. A different target *name* than the one recorded in the draft's provenance is only a warning: a
    fine-tuned or re-uploaded copy of the same model is a legitimate host, but acceptance may suffer.
    """
    tcfg = target.config.get_text_config()
    if tcfg.vocab_size != config.vocab_size:
        raise ValueError(
            f"Draft/target vocabulary mismatch: the draft expects vocab_size={config.vocab_size} but the target "
            f"({type(target).__name__}) has {tcfg.vocab_size}. A DSpark draft shares the target's embedding and LM "
            "head; build one for this target with `DSparkDraftModel.from_target(target)`."
        )
    if tcfg.hidden_size != config.hidden_size:
        raise ValueError(
            f"Draft/target hidden-size mismatch: the draft expects hidden_size={config.hidden_size} but the target "
            f"has {tcfg.hidden_size}. Build a draft for this target with `DSparkDraftModel.from_target(target)`."
        )
    num_layers = tcfg.num_hidden_layers
    bad = [i for i in config.target_layer_ids if not -1 <= i < num_layers - 1]
    if bad:
        raise ValueError(
            f"Draft target_layer_ids={config.target_layer_ids} do not fit a target with {num_layers} layers: "
            f"{bad} out of the allowed range -1..{num_layers - 2} (-1 is the embedding output; the final layer is "
            "excluded). Was this draft "
            f"trained for a different target (recorded: {config.target_name_or_path!r})?"
        )
    recorded = config.target_name_or_path
    actual = getattr(tcfg, "name_or_path", None) or None
    if recorded and actual and _short_name(recorded) != _short_name(actual):
        warnings.warn(
            f"This draft was built for target {recorded!r} but is used with {actual!r}. Shapes match, so "
            "generation stays exact, but acceptance (and so speed) may be lower.",
            stacklevel=3,
        )


def _short_name(name: str) -> str:
    """Compare Hub ids and local folders by their last path component (`org/Model` ~ `/cache/Model`)."""
    return str(name).rstrip("/").split("/")[-1].lower()
