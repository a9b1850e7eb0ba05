"""The eager backend: the draft side of a round as plain PyTorch calls (`dspark_hf.decoding.drafting`), for any
number of rows, on any device. Always eligible and never declines; the reference the other backends are tested
against."""

from __future__ import annotations

import time

import torch

from ..drafting import draft_block, ingest, score_block
from .base import Drafted, RoundInputs


class EagerBackend:
    """[`draft_block`], then the driver's sequential head and [`score_block`]; see the package docs."""

    name = "eager"

    def __init__(self, draft, options, setup, stats=None) -> None:
        self.draft = draft
        self.temperatures = torch.tensor(
            draft.config.calibration_temperatures, dtype=torch.float32, device=draft.device
        )

    @classmethod
    def eligible(cls, draft, options, setup) -> str | None:
        return None

    def ingest(self, stores, features: list[torch.Tensor], slots: list[int] | None = None) -> None:
        ingest(self.draft, stores, features, slots=slots)

    def propose(self, inputs: RoundInputs) -> Drafted:
        """Only the positions a length fixed before drafting (`planned`) can verify are headed and sampled."""
        hidden, base_logits = draft_block(self.draft, inputs.stores, inputs.anchors, positions=inputs.planned)
        done = time.perf_counter()
        block = inputs.head(hidden, base_logits, inputs.anchors)
        return Drafted(block, score_block(block, self.temperatures), done)
