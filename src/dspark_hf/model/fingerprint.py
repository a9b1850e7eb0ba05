"""Cheap fingerprints of a target's embedding and LM head, to catch a draft bound to the wrong target.

DeepSpec and speculators checkpoints store copies of the target's embedding and LM head; dspark-hf drops them
on import and uses the bound target's own. A target of the same shape but with other weights (another model
of the family, a base instead of an instruct model) would then silently change what the draft computes, and
DeepSpec configs carry no target name for the name check to fire on. So the import keeps a fingerprint (a few
values at fixed positions) of each copy in `DSparkConfig.target_weights_fingerprint`, and `bind_target` warns
when the bound target's weights do not match it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .._transformers import model_name

_SAMPLES = 16
# bf16 keeps 8 significant bits: a checkpoint stored in bf16 and a target loaded in fp32 (or the reverse)
# differ by up to 2^-8 relative; different weights differ by O(1).
_RTOL = 1e-2


def weight_fingerprint(weight: torch.Tensor) -> list[float]:
    """`_SAMPLES` values of a `[V, d]` weight at fixed, spread-out positions (rows evenly spaced)."""
    rows, cols = weight.shape
    idx_rows = torch.linspace(0, rows - 1, _SAMPLES).round().long()
    idx_cols = (idx_rows * 7919 + 13) % cols
    with torch.no_grad():
        values = weight.detach()[idx_rows.to(weight.device), idx_cols.to(weight.device)].float().cpu()
    return [float(v) for v in values]


def fingerprint_copies(weights: dict[str, torch.Tensor], source: str) -> dict[str, Any] | None:
    """Fingerprint the target copies (`embed_tokens.weight`, `lm_head.weight`) in a checkpoint's `weights`."""
    found = {
        name.split(".")[0]: weight_fingerprint(weights[name])
        for name in ("embed_tokens.weight", "lm_head.weight")
        if name in weights and weights[name].dim() == 2
    }
    return {"source": source, **found} if found else None


def _matches(recorded: list[float], actual: list[float]) -> bool:
    a, b = torch.tensor(recorded), torch.tensor(actual)
    scale = float(a.abs().max().clamp_min(1e-12))
    return a.shape == b.shape and bool(((a - b).abs() <= _RTOL * a.abs() + 1e-3 * scale).all())


def warn_if_target_differs(recorded: dict[str, Any], embed: Any, head: Any, target: Any) -> None:
    """Warn (naming the checkpoint and the target) if `target`'s embedding / LM head differ from `recorded`."""
    differ = []
    for name, module in (("embed_tokens", embed), ("lm_head", head)):
        weight = getattr(module, "weight", None)
        if name in recorded and weight is not None and weight.dim() == 2:
            if not _matches(recorded[name], weight_fingerprint(weight)):
                differ.append(name)
    if differ:
        target_name = model_name(target)
        warnings.warn(
            f"The draft checkpoint {recorded.get('source')!r} stores copies of its target's "
            f"{' and '.join(differ)} that differ from those of the bound target {target_name!r}. The draft was "
            "trained for another model: generation stays exact, but the draft computes something other than it "
            "was trained to (acceptance will be poor). Bind the target the draft was trained for.",
            UserWarning,
            stacklevel=3,
        )
