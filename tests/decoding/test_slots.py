"""The engine's KV slots: rows written in place, so a round's copy kernels do not grow with layers × rows.

`SlotKV` keeps every active request in one batch row of per-layer buffers; the padded verification forward
reads views of them and scatters each row's new keys/values at its own positions. The counting test runs the
engine's decode rounds under a `TorchDispatchMode` that counts copy-like kernels (copies, concatenations,
stacks, index-puts, scatters, pads) and checks that going from 1 to 16 rows adds fewer than one such kernel per
row and layer: the old path (every row's past re-copied into padded batch tensors, then appended again) added
about four per row and layer. Negative control: putting that old path back (the rows' pasts copied into padded
batch tensors, the committed tokens written back) must break the bound.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark_hf import DSparkEngine, SamplingParams
from dspark_hf.decoding.caches import SlotKV

from helpers import make_target

LAYERS = 8
COPY_OPS = ("copy_", "cat", "stack", "index_put", "scatter", "index_copy", "constant_pad_nd", "_to_copy", "clone")


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if any(name.startswith(op) for op in COPY_OPS):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=64, num_layers=LAYERS)


def _copies_per_round(target, rows: int, layout: str) -> float:
    engine = DSparkEngine(target, None, policy="none", max_batch_size=rows, layout=layout)
    for seed in range(rows):
        prompt = torch.randint(0, 64, (6 + seed % 7,), generator=torch.Generator().manual_seed(seed)).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.step()  # admission and prefill
    rounds = 6
    with CopyCounter() as counter:
        for _ in range(rounds):
            engine.step()
    assert len(engine._active) == rows  # every round decoded the whole batch
    return counter.count / rounds


def test_round_copies_do_not_grow_with_rows_times_layers(target):
    one, many = _copies_per_round(target, 1, "padded"), _copies_per_round(target, 16, "padded")
    assert many - one < 15 * LAYERS, (one, many)


def test_round_copy_count_has_power(target, monkeypatch):
    """The old padded path (every row's past copied into the batch tensors, per row and layer) must break it."""
    import dspark_hf.decoding.engine as engine_module
    from dspark_hf.decoding.caches import SlotRow
    from dspark_hf.decoding.target_forward import ragged_target_forward

    def copying_forward(target, store, rows, keep, layer_ids=None):
        stores = [SlotRow(store, r) for r in range(len(rows))]
        return ragged_target_forward(target, stores, rows, keep, layer_ids, "padded")

    monkeypatch.setattr(engine_module, "slot_target_forward", copying_forward)
    one, many = _copies_per_round(target, 1, "padded"), _copies_per_round(target, 16, "padded")
    assert many - one >= 15 * LAYERS, (one, many)


def _filled(store: SlotKV, rows: int, length: int) -> list[torch.Tensor]:
    """Give `rows` slots `length` tokens each, row r's values all equal to r + 1 (per layer, keys and values)."""
    like = [(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)) for _ in range(3)]
    slots = [store.add(f"req{r}") for r in range(rows)]
    store.reserve(length, like=like)
    ids = torch.tensor([s for s in slots for _ in range(length)])
    pos = torch.tensor([p for _ in slots for p in range(length)])
    data = torch.cat([torch.full((2, length, 4), float(r + 1)) for r in range(rows)], dim=1)
    store.write_tokens(ids, pos, [(data, -data)] * 3)
    for s in slots:
        store.lengths[s] = length
    return slots


def test_slots_compact_by_moving_only_the_rows_that_fill_holes():
    store = SlotKV(max_slots=6)
    _filled(store, 5, 3)
    store.lengths[4] = 2
    store.free(1)
    store.free(4)  # the last row: it just leaves
    moved = store.compact()
    assert moved == [("req3", 1)]
    assert store.owners == ["req0", "req3", "req2"] and store.lengths == [3, 3, 3]
    for slot, value in zip(range(3), (1.0, 4.0, 3.0)):
        for i in range(3):
            keys, values = store.layer(slot, i)
            assert torch.equal(keys, torch.full((2, 3, 4), value)) and torch.equal(values, -keys)
    store.free(0), store.free(1), store.free(2)
    store.compact()
    assert len(store) == 0 and store.nbytes == 0  # idle: the memory is given back


def test_slots_grow_and_shrink_keeping_live_rows():
    store = SlotKV(max_slots=4)
    _filled(store, 2, 5)
    before = [store.layer(s, 0)[0].clone() for s in range(2)]
    store.add("late")
    store.reserve(40)  # one more row and a longer capacity: live rows kept
    assert store.allocated_rows == 3 and store.capacity >= 40
    assert all(torch.equal(store.layer(s, 0)[0], b) for s, b in zip(range(2), before))
    store.free(0)
    store.compact()
    store.shrink(8)
    assert store.owners == ["late", "req1"]  # the last row (empty) moved into the hole at 0
    assert store.allocated_rows == 2 and store.capacity == 8
    assert torch.equal(store.layer(1, 0)[0], before[1]) and len(store.layer(0, 0)[0][0]) == 0
