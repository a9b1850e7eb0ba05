"""What every backend takes and returns: one round's inputs for R rows, and the drafted block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..drafting import BlockScores, DraftedBlock


@dataclass
class RoundInputs:
    """One round's drafting inputs for R rows.

    Args:
        stores: the rows' draft contexts as [`draft_block`] and [`ingest`] read them: one [`KVStore`] per row
            (`generate()`), or the engine's `SlotKV`, whose slots `0..R-1` are the rows.
        rows (`list`): each row's own store (a `KVStore`, or the engine's `SlotRow`), what the graphs mirror.
        slots (`list[int]`, *optional*): the rows' slots in the `SlotKV` (the engine), for [`ingest`].
        anchors (`torch.LongTensor` of shape `(R,)`): each row's last committed token, on the draft's device.
        planned (`int`, *optional*): a length the policy fixed before drafting (only those positions are headed).
        head (`Callable`): the driver's sequential head, `head(hidden [R, P, d], base_logits [R, P, K], anchors)`
            -> [`DraftedBlock`] (its processors, draws and random sources are the driver's: [`sample_block`]).
        greedy (`bool`): every row is greedy without processors.
        generator (*optional*): the random source(s) of a sampling round's graph noise.
    """

    stores: Any
    rows: list
    slots: list[int] | None
    anchors: torch.Tensor
    planned: int | None = None
    head: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], DraftedBlock] | None = None
    greedy: bool = True
    generator: Any = None


@dataclass
class Drafted:
    """What a backend proposes: the block (tokens, `q`, confidence logits, on the device), its scores, and
    `backbone_done` (`perf_counter` when the backbone finished: the rest is the sequential head)."""

    block: DraftedBlock
    scores: BlockScores
    backbone_done: float
