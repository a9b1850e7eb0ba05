"""The compiled backend: `generate()`'s drafting round (one row) as the exact kernels' compiled calls
(`dspark_hf.decoding.compiled`), drafting bit for bit what the eager backend drafts on those kernels.

Eligible for one row only (its buffers are one [`KVStore`]; the engine's rows live in a shared `SlotKV`), with the
`compiled` option on and a draft [`CompiledRound.create`] accepts (the exact CPU kernels, Qwen3-style layers).
Greedy rounds without processors run all three calls; other rounds take the compiled block and the eager
sequential head.
"""

from __future__ import annotations

import time

import torch

from ..compiled import CompiledRound
from ..compiled import eligible as compiled_eligible
from ..drafting import DraftedBlock, score_block
from .base import Drafted, RoundInputs


class CompiledBackend:
    """The compiled round behind the backend interface (see the package docs)."""

    name = "compiled"

    def __init__(self, draft, options, setup, stats=None) -> None:
        self.draft = draft
        self.round = CompiledRound.create(draft, setup.max_length)
        self.greedy = not setup.do_sample and not setup.processors
        self.temperatures = torch.tensor(
            draft.config.calibration_temperatures, dtype=torch.float32, device=draft.device
        )

    @classmethod
    def eligible(cls, draft, options, setup) -> str | None:
        if not options.compiled:
            return "the compiled option is off"
        if setup.rows != 1 or setup.per_row_sampling:
            return "the compiled round drafts one row (generate()); the engine's rows share a slot store"
        if not draft.is_bound or not compiled_eligible(draft):
            return "the draft is not on the exact CPU kernels' lean path (see dspark_hf.decoding.compiled)"
        if not CompiledRound.available():
            return "the exact kernels' extension is not built"
        return None

    def ingest(self, stores, features: list[torch.Tensor], slots: list[int] | None = None) -> None:
        self.round.ingest(stores[0], features[0])

    def propose(self, inputs: RoundInputs) -> Drafted:
        anchor = int(inputs.anchors[0])  # a CPU tensor: this backend runs on the CPU only, where a read is free
        hidden, base_logits = self.round.block(inputs.stores[0], anchor, inputs.planned)
        done = time.perf_counter()
        if self.greedy:  # a greedy round returns no `q`: transformers compares tokens and never reads it
            tokens, conf = self.round.greedy(hidden, base_logits, anchor)
            block = DraftedBlock(tokens[None], None, conf[None] if conf is not None else None)
        else:
            block = inputs.head(hidden[None], base_logits[None], inputs.anchors)
        return Drafted(block, score_block(block, self.temperatures), done)
