"""Draft-side vocabulary subsets (FR-Spec style): which token ids a draft may propose, and their weight rows.

A draft restricted to a subset `S` of `K` frequent token ids computes its logits only for `S`
(`hidden @ W_head[S].T` instead of the full `V`-column LM head), which is most of its drafting cost on a
large-vocabulary target. Generation stays lossless: see `docs/draft-vocab.md` and
[`DSparkDraftModel.set_draft_vocab`].

This module owns the two pieces that are not model code:

* [`frequent_token_ids`]: pick `S` from token-id data (e.g. the rows of a `dspark prepare-data` JSONL);
* [`SubsetRows`]: the rows `W[S]` of a weight matrix, gathered once and reused until the weight or `S`
  changes (gathering them per call would copy as many bytes as the product itself reads).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def _as_ids(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).reshape(-1)


def frequent_token_ids(
    sequences: Iterable,
    k: int,
    always: Sequence[int] = (),
    vocab_size: int | None = None,
) -> torch.LongTensor:
    """The `k` most frequent token ids of `sequences`, always including the ids in `always`.

    Args:
        sequences (`Iterable`): token-id sequences (lists or 1-D tensors), or `(input_ids, loss_mask)` pairs,
            in which case only the tokens whose mask is true are counted (the assistant tokens of a
            `dspark prepare-data` JSONL: exactly what the target generates and the draft should propose).
            A [`~dspark_hf.train.data.TokenDataset`] from `load_token_dataset` yields such pairs.
        k (`int`): size of the subset, `>= 1`.
        always (`Sequence[int]`, *optional*): ids to include whatever their count, e.g. the EOS and
            end-of-turn tokens; they count towards `k`.
        vocab_size (`int`, *optional*): when given, every id must lie in `[0, vocab_size)`.

    Returns:
        `torch.LongTensor` of shape `(K,)`: sorted ascending, `K = min(k, distinct ids seen + always)`. Ties
        in frequency go to the smaller id, so the result is deterministic.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}.")
    forced = sorted({int(t) for t in always})
    if len(forced) > k:
        raise ValueError(f"`always` holds {len(forced)} distinct ids but k={k}; raise k or pass fewer ids.")
    chunks = []
    for item in sequences:
        if isinstance(item, tuple) and len(item) == 2 and not isinstance(item[0], int):
            ids, mask = _as_ids(item[0]), torch.as_tensor(item[1], dtype=torch.bool).reshape(-1)
            if ids.numel() != mask.numel():
                raise ValueError(f"A sequence has {ids.numel()} ids but {mask.numel()} loss-mask entries.")
            ids = ids[mask]
        else:
            ids = _as_ids(item)
        chunks.append(ids)
    ids = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)
    everything = torch.cat([ids, torch.tensor(forced, dtype=torch.long)])
    if not everything.numel():
        raise ValueError("No token ids to count: `sequences` is empty (or fully masked) and `always` is empty.")
    if int(everything.min()) < 0:
        raise ValueError(f"Token ids must be >= 0, got {int(everything.min())}.")
    if vocab_size is not None and int(everything.max()) >= vocab_size:
        raise ValueError(f"Token id {int(everything.max())} is outside the vocabulary [0, {vocab_size}).")
    counts = torch.bincount(ids, minlength=int(everything.max()) + 1)
    counts[forced] = -1  # taken anyway; keep them out of the ranking
    # a stable sort on descending counts keeps ascending ids within a tie
    order = torch.sort(-counts, stable=True).indices
    ranked = order[counts[order] > 0][: k - len(forced)]
    return torch.sort(torch.cat([ranked, torch.tensor(forced, dtype=torch.long)])).values


def validate_vocab_ids(token_ids, vocab_size: int) -> torch.LongTensor:
    """Check a draft vocabulary and return it as a sorted `LongTensor` `[K]`.

    Raises `ValueError` unless the ids are integers, unique, within `[0, vocab_size)` and `1 <= K <= vocab_size`.
    """
    ids = torch.as_tensor(token_ids).reshape(-1)
    if not 1 <= ids.numel() <= vocab_size:
        raise ValueError(
            f"A draft vocabulary needs between 1 and {vocab_size} (the vocabulary size) ids, got {ids.numel()}. "
            "Use `set_draft_vocab(None)` for the full vocabulary."
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"Draft vocabulary ids must be integers, got dtype {ids.dtype}.")
    ids = ids.to(torch.long)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"Draft vocabulary id {bad} is outside the vocabulary [0, {vocab_size}).")
    ids = torch.sort(ids).values
    repeats = ids[1:][ids[1:] == ids[:-1]]
    if repeats.numel():
        raise ValueError(
            f"Draft vocabulary ids must be unique; {repeats.unique()[:5].tolist()} appear more than once. "
            "Deduplicate them, e.g. with `torch.unique(ids)`."
        )
    return ids


class SubsetRows:
    """Rows `weight[ids]` of a weight matrix (or entries of a bias vector), cached until `weight` or `ids` change.

    The cache key covers the tensors' identity, storage, in-place version counter, dtype and device, so an
    optimizer step, a `.to()` or a new subset all trigger a fresh gather. Under autograd (a weight that
    requires grad while grad mode is on) nothing is cached, so gradients flow as through plain indexing.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._rows: torch.Tensor | None = None

    @staticmethod
    def _fingerprint(t: torch.Tensor) -> tuple:
        return (id(t), t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape))

    def __call__(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and weight.requires_grad:
            return weight[ids.to(weight.device)]
        if torch.compiler.is_compiling():  # a traced graph gathers the rows itself (no Python-side cache)
            return weight.detach()[ids.to(weight.device)]
        key = self._fingerprint(weight) + self._fingerprint(ids)
        if key != self._key:
            self._rows = weight.detach()[ids.to(weight.device)].contiguous()
            self._key = key
        return self._rows
