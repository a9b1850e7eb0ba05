"""Greedy acceptance of many rows at once (`accept_greedy_rows`) gives each row what `greedy_accept` gives it alone,
whether the rows' logits are slices of one packed tensor (one argmax over it) or separate tensors."""

from __future__ import annotations

import torch

from dspark_hf.decoding.target_forward import _row_choices, accept_greedy_rows
from dspark_hf.decoding.verification import greedy_accept

VOCAB = 50


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 6, (sum(n + 1 for n in lengths), VOCAB), generator=g).float()  # many ties
    packed[3, 7] = float("nan")
    rows, at = [], 0
    for n in lengths:
        rows.append(packed[at : at + n + 1])
        at += n + 1
    drafts = torch.randint(0, VOCAB, (len(lengths), max(lengths) + 1), generator=g)
    for r, n in enumerate(lengths):  # most drafts right, so acceptance runs deep
        choice = rows[r].argmax(dim=-1)
        drafts[r, :n] = torch.where(torch.rand(n, generator=g) < 0.8, choice[:n], drafts[r, :n])
    return packed, rows, drafts


def test_packed_rows_accept_as_each_row_alone():
    lengths = [0, 3, 1, 5, 5, 2, 0, 4]
    _, rows, drafts = _rows(lengths)
    assert all(row._base is rows[0]._base for row in rows)  # the packed path's precondition
    expected = [greedy_accept(drafts[r, :n], rows[r]) for r, n in enumerate(lengths)]
    assert accept_greedy_rows(drafts, lengths, rows) == expected
    separate = [row.clone() for row in rows]  # no shared base: one argmax per row
    assert accept_greedy_rows(drafts, lengths, separate) == expected
    assert sum(n for n, _ in expected) > len(lengths)  # the drafts were accepted, not only the bonus tokens read


def test_row_choices_read_each_rows_own_positions():
    lengths = [2, 0, 4, 1]
    packed, rows, _ = _rows(lengths, seed=1)
    subset = [rows[2], rows[0]]  # any rows of the packed tensor, in any order
    width = 5
    got = _row_choices(subset, width)
    for i, row in enumerate(subset):
        n = row.shape[0]
        assert torch.equal(got[i, :n], row.argmax(dim=-1))
    assert not torch.equal(got[0, :3], got[1, :3])  # a control: the rows' choices differ
