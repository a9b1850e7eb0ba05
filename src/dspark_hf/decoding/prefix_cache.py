"""The engine's prefix cache: prompts that begin like an earlier prompt skip prefilling that beginning.

Served traffic repeats prompt beginnings: a chat template's system message, a few-shot header, a conversation's
earlier turns re-sent with the next one. [`PrefixCache`] keeps the target's keys and values (and, with a draft,
the target features the draft reads) of prompt tokens the engine has prefilled, in blocks of
[`PREFIX_BLOCK`] tokens, each block keyed by its tokens and by the block before it, so a block is found only
after the very same tokens from the prompt's start. A new request copies its longest cached beginning into its
KV slot and prefills only the rest (at least its last token, whose logits give the first token).

Exact by construction on the exact kernels (the only modes the engine enables it in): there a token's keys,
values and features depend only on the tokens up to it, never on which rows or chunks shared its forward, so
the copied values are the bits the request's own prefill would have computed. `tests/decoding/test_prefix_cache.py`
checks the output against plain decoding of each prompt alone, with hits, and that a corrupted cache changes
it (the cache is really read).

Blocks are evicted least recently used first, over a byte budget; a block's parents are always more recently
used than it, so eviction takes chains from their ends.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .caches import SlotKV

#: Tokens per cached block: a prompt's beginning is reused in whole blocks.
PREFIX_BLOCK = 8

#: The engine's prefix-cache budget in bytes when none is given (on the exact kernels; off elsewhere).
DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20


@dataclass
class _Block:
    id: int
    key: tuple
    kv: torch.Tensor  # [2 * layers, kv_heads, PREFIX_BLOCK, head_dim]: layer l's keys at 2l, values at 2l + 1
    features: torch.Tensor | None  # [PREFIX_BLOCK, F] target features (with a draft), else None
    nbytes: int


@dataclass
class PrefixProgress:
    """One request's place in the cache while it is prefilled: the cached blocks its prompt begins with."""

    chain: list[int] = field(default_factory=list)  # ids of the blocks covering prompt[: cached]
    cached: int = 0  # prompt tokens in whole cached blocks (restored, or inserted from this request)
    tail: torch.Tensor | None = None  # features of prompt[cached : prefilled] (a partial block), with a draft


class PrefixCache:
    """Keys, values and target features of prompt beginnings, in blocks of [`PREFIX_BLOCK`] tokens.

    Args:
        max_bytes (`int`): the most bytes of blocks kept (least recently used evicted first).
        block_size (`int`, *optional*): tokens per block.
    """

    def __init__(self, max_bytes: int, block_size: int = PREFIX_BLOCK) -> None:
        if max_bytes < 0 or block_size < 1:
            raise ValueError(f"a prefix cache needs max_bytes >= 0 and block_size >= 1, got {max_bytes}, {block_size}.")
        self.max_bytes, self.block_size = max_bytes, block_size
        self.nbytes = 0
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._index: dict[tuple, _Block] = {}
        self._ids = itertools.count(1)  # 0 is the root: the parent of every prompt's first block

    def __len__(self) -> int:
        """`int`: blocks held."""
        return len(self._blocks)

    @property
    def tokens(self) -> int:
        """`int`: tokens held (blocks × block size)."""
        return len(self._blocks) * self.block_size

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self._index.clear()
        self.nbytes = 0

    # ------------------------------------------------------------------ reading
    def restore(self, prompt: list[int], store: SlotKV, slot: int) -> tuple[PrefixProgress, torch.Tensor | None]:
        """Copy the longest cached beginning of `prompt` (whole blocks, leaving at least its last token) into
        `slot` of `store` and set the slot's length to it.

        Returns:
            `(progress, features)`: the request's [`PrefixProgress`], and the restored tokens' target features
            (`None` when nothing was restored or the blocks hold none).
        """
        chain, parent = [], 0
        for start in range(0, len(prompt) - 1 - self.block_size + 1, self.block_size):
            block = self._index.get((parent, tuple(prompt[start : start + self.block_size])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        if not chain:
            return PrefixProgress(), None
        self._touch([b.id for b in chain])
        n = len(chain) * self.block_size
        store.write_prefix(slot, torch.cat([b.kv for b in chain], dim=2) if len(chain) > 1 else chain[0].kv)
        features = None
        if chain[0].features is not None:
            features = torch.cat([b.features for b in chain]) if len(chain) > 1 else chain[0].features
        return PrefixProgress(chain=[b.id for b in chain], cached=n), features

    # ------------------------------------------------------------------ writing
    def extend(
        self,
        progress: PrefixProgress,
        prompt: list[int],
        prefilled: int,
        store: SlotKV,
        slot: int,
        features: torch.Tensor | None = None,
    ) -> None:
        """After a chunk of `prompt` is committed (its first `prefilled` tokens are now in `slot`): cache the
        whole blocks it completed. `features`: the chunk's target features (with a draft), in order. After the
        last chunk the features of the last partial block, never cached, are let go."""
        if features is not None:
            progress.tail = features if progress.tail is None else torch.cat([progress.tail, features])
        self._extend(progress, prompt, prefilled, store, slot)
        if prefilled == len(prompt):
            progress.tail = None

    def _extend(self, progress: PrefixProgress, prompt: list[int], prefilled: int, store: SlotKV, slot: int) -> None:
        stop = prefilled // self.block_size * self.block_size
        if stop <= progress.cached or self.max_bytes == 0:
            return
        start, b = progress.cached, self.block_size
        kv = torch.stack([t[:, start:stop] for i in range(store.num_layers) for t in store.layer(slot, i)])
        self._touch(progress.chain)  # the request's own chain is not what makes room for its next blocks
        parent = progress.chain[-1] if progress.chain else 0
        for at in range(start, stop, b):
            key = (parent, tuple(prompt[at : at + b]))
            block = self._index.get(key)
            if block is None:  # (a request prefilled beside an equal beginning may have cached it first)
                feats = progress.tail[at - start : at - start + b].clone() if progress.tail is not None else None
                part = kv[:, :, at - start : at - start + b].clone()
                nbytes = part.nbytes + (feats.nbytes if feats is not None else 0)
                if not self._make_room(nbytes):
                    break
                block = _Block(next(self._ids), key, part, feats, nbytes)
                self._index[key] = block
                self._blocks[block.id] = block
                self.nbytes += nbytes
            self._blocks.move_to_end(block.id)  # not evicted while its children are added
            progress.chain.append(block.id)
            progress.cached = at + b
            parent = block.id
        if progress.tail is not None:
            progress.tail = progress.tail[progress.cached - start :]
        self._touch(progress.chain)

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used blocks until `nbytes` more fit; `False` if they never can."""
        if nbytes > self.max_bytes:
            return False
        while self.nbytes + nbytes > self.max_bytes:
            _, old = self._blocks.popitem(last=False)
            del self._index[old.key]
            self.nbytes -= old.nbytes
        return True

    def _touch(self, chain: list[int]) -> None:
        """Mark a chain used, its first block last: a block's parents stay more recent than it."""
        for block_id in reversed(chain):
            if block_id in self._blocks:
                self._blocks.move_to_end(block_id)
