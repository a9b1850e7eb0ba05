"""The runtime options of speculative decoding, resolved in one place.

Every option that changes *how* a round runs (not what it outputs: verification decides that) is a field of
[`SpeculationOptions`], and [`resolve_options`] is the one function that fills it, with one precedence:

1. the call (a `generate()` keyword, a `DSparkEngine(...)` argument, a CLI flag);
2. the call's `GenerationConfig` (`dspark_policy`, `dspark_lookup`, ...);
3. the draft's own defaults: its `generation_config.json`, saved and loaded with its weights (as transformers
   stores an assistant's `num_assistant_tokens`);
4. the library's default.

`generate()`, `DSparkEngine`, `dspark serve`, `dspark eval`, the demo and the CLI all call it; nothing else
reconciles an option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scheduling.policies import VerificationPolicy
    from .lookup import LookupConfig


@dataclass(frozen=True)
class SpeculationOptions:
    """The resolved runtime options of one driver (one `generate()` call, one `DSparkEngine`).

    Args:
        policy ([`VerificationPolicy`]): how many drafted tokens each round verifies.
        lookup ([`LookupConfig`] or `None`): prompt lookup as a proposer tried before the draft; `None` is off.
        cuda_graphs (`bool`): capture the draft step as a CUDA graph (CUDA drafts only).
        kernels (`str`): the target's kernel mode, one of `dspark_hf.kernels.KERNEL_MODES`.
        compiled (`bool`): run the drafting round as compiled calls where that backend is eligible.
    """

    policy: VerificationPolicy
    lookup: LookupConfig | None
    cuda_graphs: bool
    kernels: str
    compiled: bool
