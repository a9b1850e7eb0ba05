"""The one store for committed keys/values, used by the draft (in `generate()` and the engine) and the engine's target.

A [`KVStore`] holds one sequence's keys/values, one `[kv_heads, T, head_dim]` pair per layer, in buffers that
are preallocated, grow geometrically (doubling, capped at the reservation) and are written in place: a round
copies only its new tokens, never the history. The draft's store holds only *committed* context (the block's
own keys/values are never stored), so it needs no rollback when drafted tokens are rejected.
"""

from __future__ import annotations

import torch


class KVStore:
    """Keys and values of one request's committed tokens, per layer `[kv_heads, T, head_dim]`.

    Args:
        max_tokens (`int`): the request's reservation; appending beyond it is a bookkeeping error.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.length = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """`int`: bytes allocated (capacity, not just the used length)."""
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[kv_heads, T, head_dim]` of layer `i`'s keys and values."""
        return self._keys[i][:, : self.length], self._values[i][:, : self.length]

    def append(self, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append `n` tokens: one `(keys, values)` pair `[kv_heads, n, head_dim]` per layer."""
        n = kvs[0][0].shape[1]
        needed = self.length + n
        if needed > self.max_tokens:
            raise RuntimeError(f"KV store overflow: {needed} tokens for a reservation of {self.max_tokens}.")
        if not self._keys or needed > self._keys[0].shape[1]:
            # doubling keeps appends amortised O(n); the cap keeps memory within the reservation
            capacity = min(self.max_tokens, max(needed, 2 * (self._keys[0].shape[1] if self._keys else 0), 16))
            self._keys = [self._grow(old, k, capacity) for old, (k, _) in _zip_old(self._keys, kvs)]
            self._values = [self._grow(old, v, capacity) for old, (_, v) in _zip_old(self._values, kvs)]
        for i, (k, v) in enumerate(kvs):
            self._keys[i][:, self.length : needed] = k
            self._values[i][:, self.length : needed] = v
        self.length = needed

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        buf = like.new_empty(like.shape[0], capacity, like.shape[2])
        if old is not None:
            buf[:, : self.length] = old[:, : self.length]
        return buf


def _zip_old(old: list[torch.Tensor], kvs: list) -> list:
    return list(zip(old if old else [None] * len(kvs), kvs))
