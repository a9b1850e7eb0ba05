"""The drafting backends: one module per way of running the draft side of a round, behind one dispatcher list.

Every backend has the same two methods (vLLM's proposers have one `propose()`):

* `ingest(stores, features, slots=None)`: newly committed target features into the rows' draft contexts (the
  stores as [`ingest`] takes them);
* `propose(inputs) -> Drafted | None` (a [`RoundInputs`] in): the drafted block of every row, its scores and
  when the backbone finished; `None` declines *this* round (the next backend in the list runs it).

and a class method `eligible(draft, options, setup) -> str | None` that says, once per driver, why the backend
cannot run there (`None`: it can). [`choose_backends`] keeps the eligible ones in the order of [`BACKENDS`]; the
first one drafts, and a round it declines goes to the next (PEFT's LoRA dispatchers: a plain list, the first
eligible wins). The eager backend is always eligible and never declines, so every round drafts.

| backend | module | runs where | declines |
|---|---|---|---|
| CUDA graphs | `graphs.py` | a CUDA draft with `cuda_graphs` on and graph-safe processors | rounds with a sampling row or processors in the engine (it captures greedy rows only); every round after a failed capture |
| compiled round | `compiled.py` | one row (`generate()`), `compiled` on, the draft on the exact CPU kernels | never |
| eager | `eager.py` | everywhere | never |

Whatever a backend drafts, verification is the target's: output never depends on the backend
(`tests/decoding/test_compiled_round.py` and `tests/decoding/test_graphs.py` check they draft what the eager backend drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..draft_graphs import report_fallback
from .base import Drafted, RoundInputs
from .compiled import CompiledBackend
from .eager import EagerBackend
from .graphs import GraphsBackend

#: The backends in order of preference: the first eligible one drafts.
BACKENDS = (GraphsBackend, CompiledBackend, EagerBackend)


@dataclass(frozen=True)
class BackendSetup:
    """What a driver tells the backends about its rounds, once.

    Args:
        rows (`int`): the most rows a round drafts (1 for `generate()`, `max_batch_size` for the engine).
        max_length (`int`): the longest sequence a row reaches (the compiled round's buffers).
        processors (`LogitsProcessorList`, *optional*): processors every row applies (`generate()`'s); the
            engine's rows bring their own each round (`per_row_sampling=True`).
        do_sample (`bool`): every row samples (`generate()`'s mode).
        per_row_sampling (`bool`): rows differ in mode and processors from round to round (the engine).
    """

    rows: int = 1
    max_length: int = 0
    processors: object = None
    do_sample: bool = False
    per_row_sampling: bool = False


def choose_backends(draft, options, setup: BackendSetup, stats=None) -> list:
    """The eligible backends for one driver, in the order of [`BACKENDS`] (the eager one always last).

    Where the CUDA-graph backend was asked for (`options.cuda_graphs`) but cannot run, the reason is logged once
    and recorded in `stats.cuda_graphs_fallback`.
    """
    chosen = []
    for backend in BACKENDS:
        reason = backend.eligible(draft, options, setup)
        if reason is None:
            chosen.append(backend(draft, options, setup, stats=stats))
        elif backend is GraphsBackend and options.cuda_graphs:  # asked for, but it cannot run: say why, once
            report_fallback(reason, explicit=True, stats=stats)
    return chosen


__all__ = [
    "BACKENDS",
    "BackendSetup",
    "RoundInputs",
    "CompiledBackend",
    "Drafted",
    "EagerBackend",
    "GraphsBackend",
    "choose_backends",
]
