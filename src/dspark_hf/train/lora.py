"""Domain adaptation of an existing draft with LoRA (`peft`): train an adapter, load it, merge it.

A draft trained on general chat can be adapted to a new domain (code, math, a product's traffic) by
training only low-rank adapters on its backbone's linear layers, plus (by default) the tiny confidence head
in full, since its calibration is domain-specific. Only the adapter is saved (`adapter_model.safetensors`,
typically a few percent of the draft); its `adapter_config.json` records the base draft's path.

peft injects the LoRA layers into the draft's own modules, so the wrapped [`DSparkDraftModel`] (what
[`load_draft_with_adapter`] returns) runs `generate()` with the adapter active, unmerged.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

from .args import LoraArguments, require


@contextmanager
def _quiet_peft():
    # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning;
    # the warning is about peft's code, not ours, and the test-suite turns transformers FutureWarnings into errors.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def apply_lora(draft, args: LoraArguments, base_path: str | None = None):
    """Wrap `draft` in a `PeftModel` with fresh LoRA adapters; only adapter (and `modules_to_save`) weights train.

    Args:
        draft ([`DSparkDraftModel`]): the draft to adapt (its weights stay frozen).
        args ([`LoraArguments`]): rank, alpha, dropout, target modules, modules trained in full.
        base_path (`str`, *optional*): where the base draft lives; recorded in the adapter config.

    Returns:
        `peft.PeftModel`
    """
    peft = require("peft", "LoRA fine-tuning")
    config = peft.LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(args.lora_target_modules),
        modules_to_save=list(args.lora_modules_to_save) or None,
    )
    with _quiet_peft():
        model = peft.get_peft_model(draft, config)
    if base_path is not None:
        model.peft_config["default"].base_model_name_or_path = os.fspath(base_path)
    return model


def load_draft_with_adapter(draft_path: str, adapter_path: str, target=None, merge: bool = False):
    """Load a draft and a LoRA adapter trained on it, ready for `target.generate(assistant_model=...)`.

    Args:
        draft_path (`str`): the base draft (folder or Hub id).
        adapter_path (`str`): the adapter folder written by `dspark train --lora`.
        target (`PreTrainedModel`, *optional*): bind the draft to this target.
        merge (`bool`, *optional*, defaults to `False`): fold the adapter into the weights (faster drafting,
            no peft layers left); otherwise the adapter stays separate and active.

    Returns:
        [`DSparkDraftModel`]: the draft with the adapter applied (as injected peft layers, or merged).
    """
    peft = require("peft", "Loading a LoRA adapter")
    from ..model.modeling import DSparkDraftModel

    draft = DSparkDraftModel.from_pretrained(draft_path, target=target)
    with _quiet_peft():
        model = peft.PeftModel.from_pretrained(draft, adapter_path)
    model.eval()
    if merge:
        with _quiet_peft():
            merged = model.merge_and_unload()
        return merged
    return model.get_base_model()


def merge_adapter(draft_path: str, adapter_path: str, output_dir: str, target=None):
    """Merge an adapter into its base draft and save the result as an ordinary draft in `output_dir`.

    Returns:
        [`DSparkDraftModel`]: the merged draft (also saved, safetensors only).
    """
    merged = load_draft_with_adapter(draft_path, adapter_path, target=target, merge=True)
    merged.save_pretrained(output_dir, safe_serialization=True)
    return merged
