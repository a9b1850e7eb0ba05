"""The one store for committed keys/values, used by the draft (in `generate()` and the engine) and the engine's target.

A [`KVStore`] holds one sequence's keys/values (the draft's context in `generate()`), one `[kv_heads, T, head_dim]` pair per layer, in buffers that
are preallocated, grow geometrically (doubling, capped at the reservation) and are written in place: a round
copies only its new tokens, never the history. The draft's store holds only *committed* context (the block's
own keys/values are never stored), so it needs no rollback when drafted tokens are rejected.

A [`SlotKV`] holds the engine's rows (target and draft alike) in shared per-layer buffers, one slot per request,
so that a batched forward reads and writes them in place.
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

    @property
    def num_layers(self) -> int:
        return len(self._keys)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[kv_heads, T, head_dim]` of layer `i`'s keys and values."""
        return self._keys[i][:, : self.length], self._values[i][:, : self.length]

    def append(self, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append `n` tokens: one `(keys, values)` pair `[kv_heads, n, head_dim]` per layer."""
        n = kvs[0][0].shape[1]
        needed = self.length + n
        if needed > self.max_tokens:
            raise RuntimeError(f"KV store overflow: {needed} tokens for a reservation of {self.max_tokens}.")
        self._ensure(needed, kvs, self.max_tokens)
        for i, (k, v) in enumerate(kvs):
            self._keys[i][:, self.length : needed] = k
            self._values[i][:, self.length : needed] = v
        self.length = needed

    def reserve(
        self,
        needed: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        limit: int,
    ) -> None:
        """Make every layer's buffers hold at least `needed` positions (allocating them if there are none yet),
        without writing anything; for callers that write the buffers in place (`dspark_hf.decoding.compiled`).
        Capacity doubles as in [`append`], capped at `limit` (which may exceed `max_tokens`: positions past the
        committed length are scratch space)."""
        if needed > limit:
            raise RuntimeError(f"KV store overflow: {needed} positions for a limit of {limit}.")
        like = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._ensure(needed, [(like, like)] * num_layers, limit)

    def _ensure(self, needed: int, likes: list[tuple[torch.Tensor, torch.Tensor]], limit: int) -> None:
        """Grow every layer's buffers (shaped and typed like `likes`' keys and values) to hold `needed` positions:
        doubling keeps appends amortised O(n); `limit` caps the memory."""
        current = self._keys[0].shape[1] if self._keys else 0
        if needed <= current:
            return
        capacity = min(limit, max(needed, 2 * current, 16))
        self._keys = [self._grow(old, k, capacity) for old, (k, _) in _zip_old(self._keys, likes)]
        self._values = [self._grow(old, v, capacity) for old, (_, v) in _zip_old(self._values, likes)]

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        buf = like.new_empty(like.shape[0], capacity, like.shape[2])
        if old is not None:
            buf[:, : self.length] = old[:, : self.length]
        return buf


def _zip_old(old: list[torch.Tensor], kvs: list) -> list:
    return list(zip(old if old else [None] * len(kvs), kvs))


class SlotKV:
    """Keys and values of many sequences in shared per-layer buffers `[slots, kv_heads, capacity, head_dim]`.

    The engine keeps every active request in one *slot* (a batch row), so a round's target forward reads the
    batch's past as views `[:rows, :, :past]` of these buffers and writes its new keys/values into them in
    place, at each row's own positions (`dspark_hf._transformers.slot_cache` scatters them): a
    round launches O(layers) copy kernels, not O(layers × rows), and never copies the history. Rolling back
    rejected drafts is only not advancing a row's length: their keys sit beyond it, masked out, until the next
    round overwrites them.

    Slots `0..n-1` are the live rows, in batch order. A freed slot is filled by moving the last row into it
    ([`compact`], once per departure, O(layers) kernels); new rows are appended at the end.

    Args:
        max_slots (`int`): most rows at once (the engine's `max_batch_size`).
    """

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self.lengths: list[int] = []  # committed tokens per slot
        self.owners: list[object] = []  # whatever the caller keys a slot by (a request), `None` once freed
        self.limit: int | None = None  # most tokens a slot may need (the capacity grows up to it, not past)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """`int`: tokens each slot can hold before the buffers grow."""
        return self._keys[0].shape[2] if self._keys else 0

    @property
    def nbytes(self) -> int:
        """`int`: bytes allocated (all slots and the whole capacity)."""
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    @property
    def allocated(self) -> bool:
        return bool(self._keys)

    def add(self, owner) -> int:
        """A new empty row at the end; returns its slot."""
        if len(self.lengths) >= self.max_slots:
            raise RuntimeError(f"all {self.max_slots} slots are in use.")
        self.lengths.append(0)
        self.owners.append(owner)
        return len(self.lengths) - 1

    def free(self, slot: int) -> None:
        """Mark `slot` free; its row leaves at the next [`compact`]."""
        self.owners[slot] = None

    def compact(self) -> list[tuple[object, int]]:
        """Drop freed rows, moving the last live rows into the holes (only those rows are copied).

        Returns:
            `list[tuple[object, int]]`: every owner that moved, with its new slot.
        """
        moved: list[tuple[object, int]] = []
        src, dst = [], []
        hole = 0
        while True:
            while self.owners and self.owners[-1] is None:  # freed rows at the end just leave
                self.owners.pop(), self.lengths.pop()
            while hole < len(self.owners) and self.owners[hole] is not None:
                hole += 1
            if hole >= len(self.owners):
                break
            src.append(len(self.owners) - 1), dst.append(hole)  # the last row is live and after the hole
            self.owners[hole], self.lengths[hole] = self.owners.pop(), self.lengths.pop()
            moved.append((self.owners[hole], hole))
        if not self.owners:  # idle: give the memory back
            self._keys, self._values = [], []
        rows = self._keys[0].shape[0] if self._keys else 0
        pairs = [(a, b) for a, b in zip(src, dst) if a < rows]  # a slot never written (still empty) moves no data
        self._move([a for a, _ in pairs], [b for _, b in pairs])
        return moved

    def _move(self, src: list[int], dst: list[int]) -> None:
        """Copy rows `src` into slots `dst` (whose `lengths` are already the moved rows'): only the positions the
        longest of them holds, one gather and one scatter per buffer."""
        used = max((self.lengths[b] for b in dst), default=0)
        if not used or not self._keys:
            return
        s = torch.tensor(src, device=self._keys[0].device)
        d = torch.tensor(dst, device=self._keys[0].device)
        for buf in self._keys + self._values:
            held = buf[:, :, :used]  # a view: the scatter writes into the buffer
            held.index_copy_(0, d, held.index_select(0, s))

    def arrange(self, order: list[int]) -> list[tuple[object, int]]:
        """Reorder the live rows: slot `i` gets the row now in slot `order[i]` (`order` a permutation of the live
        slots, after [`compact`]). Only rows that change slot and hold tokens are copied (one gather and one
        scatter per buffer).

        Returns:
            `list[tuple[object, int]]`: every owner that moved, with its new slot.
        """
        if sorted(order) != list(range(len(self.owners))):
            raise ValueError(f"arrange() needs a permutation of the {len(self.owners)} live slots, got {order}.")
        pairs = [(src, dst) for dst, src in enumerate(order) if src != dst]
        data = [(src, dst) for src, dst in pairs if self.lengths[src] > 0]
        if data and self._keys and max(max(p) for p in data) >= self.allocated_rows:
            self.reserve(self.capacity)  # a row added since the buffers last grew: every live row gets one
        self.owners = [self.owners[src] for src in order]
        self.lengths = [self.lengths[src] for src in order]
        if data:
            self._move([a for a, _ in data], [b for _, b in data])
        return [(self.owners[dst], dst) for _, dst in pairs]

    def reserve(self, needed: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Make room for `needed` tokens in every live slot, growing slots and capacity geometrically (live
        rows are kept). The first call allocates, shaping the buffers after `like` (one `(keys, values)` per
        layer, `[..., kv_heads, n, head_dim]`)."""
        rows = self._keys[0].shape[0] if self._keys else 0
        if self._keys and needed <= self.capacity and rows >= len(self.lengths):
            return
        if not self._keys and like is None:
            raise RuntimeError("the first reserve() of a SlotKV needs `like` (the layers' key/value shapes).")
        like = like or list(zip(self._keys, self._values))
        slots = max(len(self.lengths), rows)  # exactly the rows needed: memory follows the batch's peak
        capacity = max(needed, self.capacity)
        if capacity > self.capacity:  # geometric growth, within the limit
            capacity = max(needed, min(2 * self.capacity, self.limit or 2 * self.capacity), 16 if not self.limit else 0)
        used = max(self.lengths[:rows], default=0)

        def grown(old: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
            buf = ref.new_zeros(slots, ref.shape[-3], capacity, ref.shape[-1])
            if old is not None and used:
                buf[:rows, :, :used] = old[:, :, :used]
            return buf

        olds = list(zip(self._keys, self._values)) or [(None, None)] * len(like)
        pairs = [(grown(ok, k), grown(ov, v)) for (ok, ov), (k, v) in zip(olds, like)]
        self._keys, self._values = [k for k, _ in pairs], [v for _, v in pairs]

    @property
    def num_layers(self) -> int:
        return len(self._keys)

    @property
    def allocated_rows(self) -> int:
        return self._keys[0].shape[0] if self._keys else 0

    def shrink(self, capacity: int) -> None:
        """Reallocate to exactly the live rows and `capacity` tokens (at least the longest row): returns the
        memory of departed rows and of a departed long request. Copies the live rows once."""
        if not self._keys:
            return
        rows, used = len(self.lengths), max(self.lengths, default=0)
        capacity = max(capacity, used, 1)
        if rows == self.allocated_rows and capacity >= self.capacity:
            return
        if rows == 0:
            self._keys, self._values = [], []
            return
        self._keys = [k[:rows, :, :capacity].clone() for k in self._keys]
        self._values = [v[:rows, :, :capacity].clone() for v in self._values]

    def views(self, start: int, stop: int, past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, views `[stop - start, kv_heads, past, head_dim]` of slots `start..stop-1`."""
        return [(k[start:stop, :, :past], v[start:stop, :, :past]) for k, v in zip(self._keys, self._values)]

    def buffers(self, start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the whole-capacity views of slots `start..stop-1` (what [`slot_cache`] writes into)."""
        return [(k[start:stop], v[start:stop]) for k, v in zip(self._keys, self._values)]

    def layer(self, slot: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`'s committed keys and values of one slot, `[kv_heads, T, head_dim]` views."""
        n = self.lengths[slot]
        return self._keys[i][slot, :, :n], self._values[i][slot, :, :n]

    def write_prefix(self, slot: int, kv: torch.Tensor) -> None:
        """Set `slot` (an empty row) to `n` tokens: `kv` `[2 * layers, kv_heads, n, head_dim]` holds layer `i`'s
        keys at `2i` and its values at `2i + 1` (the [`PrefixCache`]'s blocks). Unallocated buffers are shaped and
        typed after `kv`."""
        n = kv.shape[2]
        like = None if self._keys else [(kv[2 * i][None], kv[2 * i + 1][None]) for i in range(kv.shape[0] // 2)]
        self.reserve(n, like=like)
        for i, (buf_k, buf_v) in enumerate(zip(self._keys, self._values)):
            buf_k[slot, :, :n] = kv[2 * i]
            buf_v[slot, :, :n] = kv[2 * i + 1]
        self.lengths[slot] = n

    def write_tokens(self, slots: torch.Tensor, positions: torch.Tensor, kvs) -> None:
        """Write tokens one by one at `(slots[t], positions[t])`: `kvs` holds per layer `(keys, values)`
        `[kv_heads, N, head_dim]` for the `N` tokens (one index-put per layer and tensor). Lengths are the
        caller's to advance."""
        for buf_k, buf_v, (k, v) in zip(self._keys, self._values, kvs):
            buf_k[slots, :, positions] = k.transpose(0, 1).to(buf_k.dtype)
            buf_v[slots, :, positions] = v.transpose(0, 1).to(buf_v.dtype)


class SlotRow:
    """One request's row of a [`SlotKV`]: its length and committed keys/values (the `KVStore` reading API)."""

    def __init__(self, store: SlotKV, slot: int) -> None:
        self.store, self.slot = store, slot

    def __len__(self) -> int:
        return self.store.lengths[self.slot]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.layer(self.slot, i)

    @property
    def num_layers(self) -> int:
        return self.store.num_layers
