"""The CUDA-graph backend: the draft step (backbone, sequential head, scores) replayed as one captured graph per
`(rows, capacity)` bucket (`dspark_hf.decoding.draft_graphs`), drafting what the eager backend drafts.

Eligible with the `cuda_graphs` option on, a CUDA draft and graph-safe processors. In `generate()` it captures the
call's own mode and processors; in the engine, where each row brings its own, it captures greedy rows without
processors and declines a round that has any other row (that round drafts eagerly). After a failed capture it
declines every round (the failure is logged once and recorded in the stats).
"""

from __future__ import annotations

import time

from .. import draft_graphs
from ..drafting import ingest
from .base import Drafted, RoundInputs


class GraphsBackend:
    """[`DraftStepGraphs`] behind the backend interface (see the package docs)."""

    name = "cuda_graphs"

    def __init__(self, draft, options, setup, stats=None) -> None:
        self.draft = draft
        self.per_row = setup.per_row_sampling
        processors = None if self.per_row else setup.processors
        do_sample = False if self.per_row else setup.do_sample
        self.graphs = draft_graphs.DraftStepGraphs(draft, processors, do_sample, stats=stats)
        self.rounds = 0  # rounds this backend drafted

    @classmethod
    def eligible(cls, draft, options, setup) -> str | None:
        if not options.cuda_graphs:
            return "the cuda_graphs option is off"
        reason = draft_graphs.graph_unavailable(draft, None if setup.per_row_sampling else setup.processors)
        if reason is not None:
            return reason
        mode = draft_graphs.DraftStepGraphs(
            draft, None if setup.per_row_sampling else setup.processors, setup.do_sample and not setup.per_row_sampling
        ).mode
        failed = draft_graphs.graph_cache(draft).failed.get(mode)
        return None if failed is None else f"an earlier capture failed ({failed})"

    def ingest(self, stores, features, slots=None) -> None:
        ingest(self.draft, stores, features, slots=slots)  # each replay mirrors the new tokens

    def propose(self, inputs: RoundInputs) -> Drafted | None:
        if self.per_row and not inputs.greedy:
            return None  # a sampling row or processors: this round drafts eagerly
        graphed = self.graphs.run(inputs.rows, inputs.anchors, inputs.generator)
        if graphed is None:
            return None  # the capture failed (logged once): eager from now on
        self.rounds += 1
        return Drafted(*graphed, time.perf_counter())
