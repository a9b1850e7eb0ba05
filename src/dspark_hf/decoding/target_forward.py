"""The target side of [`DSparkEngine`]'s round: ragged target forwards and per-row acceptance (the draft side is
[`Speculator`]'s, `dspark_hf.decoding.speculator`).

Everything here works on *rows* (one per active request) whose lengths differ, and is free of scheduling
and request bookkeeping (that is `dspark_hf.decoding.engine`); the draft side of the round is
`dspark_hf.decoding.drafting`, shared with `generate()`.

* [`ragged_target_forward`] runs ONE target forward over all rows, each with its own cached context
  ([`KVStore`], `dspark_hf.decoding.caches`) and its own number of new tokens, in one of two layouts:

  - `"padded"`: rows stacked as a batch; the past is right-padded to the longest context and the new
    tokens to the longest row. A 4D boolean mask lets each query see its own row's past and, causally, its
    own new tokens; explicit `position_ids` keep RoPE exact. Padding costs compute (`R · max n_r` tokens).
  - `"packed"`: all new tokens in one sequence (batch 1) over all rows' pasts concatenated; a
    block-diagonal causal mask separates the rows. No padded tokens, but every query's attention spans
    every row's past (`Σ T_r` keys), which grows with the batch.

  - `"auto"`: per forward, whichever [`forward_cost`] predicts cheaper. The model counts the linear layers'
    work per token against the attention's work per (query, key) pair; on a 2-core CPU with SmolLM2-135M it
    picks the faster layout in the measured cases (`docs/engine.md`): packed for ragged rows at low
    concurrency, padded for many rows or long contexts.

  All are exact (up to float rounding; tests run the tiny targets in fp64). The new keys/values of each
  row come back so the caller can keep exactly the committed ones: rolling back rejected drafts is simply
  not copying them.
* [`RequestSampler`] is one request's processors, mode and generator; [`accept_row`] applies greedy or
  rejection-sampling acceptance (`dspark_hf.decoding.verification`) to one row, [`accept_copy_row`] verifies
  a deterministic proposal (a prompt-lookup copy) against the target's own picks, and [`accept_greedy_rows`]
  verifies all greedy rows without processors at once, with one host read.
* [`build_processors`] and [`context_limit`] turn a request's sampling parameters and the target's config
  into the processors and the length cap the rows above use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .._transformers import (
    cache_kwarg,
    filled_cache,
    forward_accepts,
    forward_with_features,
    slot_cache,
)
from .caches import KVStore, SlotKV
from .verification import categorical_draw, greedy_accept, speculative_accept

LAYOUTS = ("padded", "packed", "auto")


def linear_cost_in_keys(target) -> float:
    """Work of one token through a decoder layer's linear maps, in units of one (query, key) attention pair.

    Per layer a token costs about `2 · P_layer` FLOPs in its projections and MLP, and each (query, key) pair
    about `4 · heads · head_dim` (scores and weighted values), so the ratio is `P_layer / (2 · heads · head_dim)`
    (about 3,000 for SmolLM2-135M: attention matters once a query sees thousands of keys).
    """
    config = target.config.get_text_config()
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    total = sum(p.numel() for p in target.parameters()) - embed.weight.numel()
    if head is not None and head.weight is not embed.weight:
        total -= head.weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return total / config.num_hidden_layers / (2 * heads * head_dim)


def forward_cost(layout: str, lengths: list[int], counts: list[int], linear_cost: float) -> float:
    """Predicted relative cost of a ragged forward (rows with `lengths[r]` cached and `counts[r]` new tokens).

    `padded` computes `R · max n` query tokens over `max T + max n` keys each; `packed` computes `Σ n` tokens
    over `Σ T + Σ n` keys each. A token's linear work counts as `linear_cost` keys ([`linear_cost_in_keys`]).
    """
    if layout == "padded":
        width = max(counts)
        return len(counts) * width * (linear_cost + max(lengths) + width)
    total = sum(counts)
    return total * (linear_cost + sum(lengths) + total)


def choose_layout(lengths: list[int], counts: list[int], linear_cost: float) -> str:
    """`"packed"` or `"padded"`, whichever [`forward_cost`] predicts cheaper (ties: padded)."""
    packed = forward_cost("packed", lengths, counts, linear_cost)
    return "packed" if packed < forward_cost("padded", lengths, counts, linear_cost) else "padded"


def _pad_stack(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack `[kv_heads, T_r, head_dim]` tensors into `[R, kv_heads, length, head_dim]`, zero-padded at the end."""
    first = tensors[0]
    out = first.new_zeros(len(tensors), first.shape[0], length, first.shape[2])
    for r, t in enumerate(tensors):
        out[r, :, : t.shape[1]] = t
    return out


@dataclass
class RaggedOutput:
    """Per-row results of [`ragged_target_forward`].

    Args:
        logits (`list[torch.Tensor]`): row `r`'s logits `[len(keep[r]), V]` at the requested positions.
        features (`list[torch.Tensor]` or `None`): row `r`'s selected target layers, `[n_r, m·d]`.
        new_kv (`list[list[tuple[torch.Tensor, torch.Tensor]]]`): row `r`'s new keys/values per layer,
            `[kv_heads, n_r, head_dim]` (the caller keeps the committed prefix).
        layout (`str`): the layout that ran (`"padded"` or `"packed"`).
    """

    logits: list[torch.Tensor]
    features: list[torch.Tensor] | None
    new_kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    layout: str = "padded"

    def split(self, n: int) -> tuple[RaggedOutput, RaggedOutput]:
        """The first `n` rows' results and the rest's (of a forward whose keys/values are already stored)."""
        if self.new_kv is not None:
            raise ValueError("split() is for forwards that wrote their keys/values in place (new_kv=None).")
        features = self.features
        first = RaggedOutput(self.logits[:n], None if features is None else features[:n], None, self.layout)
        rest = RaggedOutput(self.logits[n:], None if features is None else features[n:], None, self.layout)
        return first, rest


@torch.no_grad()
def ragged_target_forward(
    target,
    stores: list[KVStore],
    new_tokens: list[list[int]],
    keep: list[list[int]],
    layer_ids: list[int] | None = None,
    layout: str = "padded",
    linear_cost: float | None = None,
) -> RaggedOutput:
    """One target forward over rows with different cached contexts and different numbers of new tokens.

    Args:
        target (`PreTrainedModel`): the causal LM (full attention in every layer; see the engine's checks).
        stores (`list[KVStore]`): each row's committed keys/values; the row's new tokens start at position
            `len(stores[r])`.
        new_tokens (`list[list[int]]`): each row's new tokens (non-empty).
        keep (`list[list[int]]`): for each row, the offsets (within its new tokens) whose logits are needed.
        layer_ids (`list[int]`, *optional*): 0-based target layers whose outputs to return as features.
        layout (`str`, *optional*, defaults to `"padded"`): `"padded"`, `"packed"` or `"auto"` (module docs).
        linear_cost (`float`, *optional*): [`linear_cost_in_keys`] of the target, for `"auto"` (computed if
            not given).

    Returns:
        [`RaggedOutput`]; its `layout` says which layout ran.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    device = target.device
    lengths = [len(s) for s in stores]
    counts = [len(t) for t in new_tokens]
    if layout == "auto":
        cost = linear_cost if linear_cost is not None else linear_cost_in_keys(target)
        layout = choose_layout(lengths, counts, cost)
    build = _padded_inputs if layout == "padded" else _packed_inputs
    ids, pos, mask, spans, data, past, width = build(stores, new_tokens, lengths, counts)
    cache = filled_cache(data)
    kwargs = {cache_kwarg(target): cache, "use_cache": True}
    # Only the logits the caller needs go through the LM head (a prefill row needs just its last position).
    # `logits_to_keep` selects query positions shared by all batch rows.
    wanted = sorted({q0 + j for (_, q0, _), row_keep in zip(spans, keep) for j in row_keep})
    # ids, positions and the kept logit columns go to the device in one copy, the mask in another
    moved = torch.cat([ids.flatten(), pos.flatten(), torch.tensor(wanted, dtype=torch.long)]).to(device)
    ids, pos = moved[: ids.numel()].view(ids.shape), moved[ids.numel() : 2 * ids.numel()].view(pos.shape)
    column = {q: q for q in range(width)}
    if forward_accepts(target, "logits_to_keep"):
        kwargs["logits_to_keep"] = moved[2 * ids.numel() :]
        column = {q: i for i, q in enumerate(wanted)}
    # additive float mask (works for eager and SDPA attention alike): a large negative value where masked
    float_mask = torch.zeros(mask.shape, dtype=target.dtype).masked_fill_(~mask, torch.finfo(target.dtype).min)
    out, feats = forward_with_features(
        target, layer_ids, ids, attention_mask=float_mask.to(device), position_ids=pos, **kwargs
    )
    logits = [out.logits[b, [column[q0 + j] for j in row_keep]] for (b, q0, _), row_keep in zip(spans, keep)]
    features = None if feats is None else [feats[b, q0:q1] for b, q0, q1 in spans]
    new_kv = [
        [(layer.keys[b, :, past + q0 : past + q1], layer.values[b, :, past + q0 : past + q1]) for layer in cache.layers]
        for b, q0, q1 in spans
    ]
    return RaggedOutput(logits=logits, features=features, new_kv=new_kv, layout=layout)


@torch.no_grad()
def _layer_kv(stores: list[KVStore]):
    """`(store, layer, 0 | 1) -> keys | values`, an empty store contributing an empty slice of a filled one's."""
    filled = next((s for s in stores if len(s)), None)

    def layer_kv(store: KVStore, i: int, kv: int) -> torch.Tensor:
        return store.layer(i)[kv] if len(store) else filled.layer(i)[kv][:, :0]

    return layer_kv, (filled.num_layers if filled is not None else 0)


def _padded_inputs(stores, new_tokens, lengths, counts):
    """The padded layout's ids, positions, mask, row spans `(batch row, first query, end query)`, past keys and
    values per layer, past and width: rows stacked, the past right-padded to the longest."""
    rows, past, width = len(new_tokens), max(lengths), max(counts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    pos = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, 1, width, past + width, dtype=torch.bool)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    spans = []  # a row's new keys sit at `past + query`
    for r in range(rows):
        n, t = counts[r], lengths[r]
        ids[r, :n] = torch.tensor(new_tokens[r])
        pos[r, :n] = torch.arange(t, t + n)
        mask[r, 0, :n, :t] = True
        mask[r, 0, :n, past : past + n] = causal[:n, :n]
        mask[r, 0, n:, past + n :] = torch.eye(width - n, dtype=torch.bool)  # padding sees only itself
        spans.append((r, 0, n))
    layer_kv, num_layers = _layer_kv(stores)
    data = [tuple(_pad_stack([layer_kv(s, i, kv) for s in stores], past) for kv in (0, 1)) for i in range(num_layers)]
    return ids, pos, mask, spans, data, past, width


def _packed_inputs(stores, new_tokens, lengths, counts):
    """The packed layout's inputs (as [`_padded_inputs`]): every row's new tokens in one sequence over all rows'
    pasts concatenated, a block-diagonal causal mask separating the rows."""
    rows, past, width = len(new_tokens), sum(lengths), sum(counts)
    ids = torch.tensor([t for row in new_tokens for t in row])[None]
    pos = torch.cat([torch.arange(lengths[r], lengths[r] + counts[r]) for r in range(rows)])[None]
    mask = torch.zeros(1, 1, width, past + width, dtype=torch.bool)
    spans = []
    p_off = q_off = 0
    for r in range(rows):
        n, t = counts[r], lengths[r]
        mask[0, 0, q_off : q_off + n, p_off : p_off + t] = True
        mask[0, 0, q_off : q_off + n, past + q_off : past + q_off + n] = torch.ones(n, n, dtype=torch.bool).tril()
        spans.append((0, q_off, q_off + n))
        p_off, q_off = p_off + t, q_off + n
    layer_kv, num_layers = _layer_kv(stores)
    data = [
        tuple(torch.cat([layer_kv(s, i, kv) for s in stores], dim=1)[None] for kv in (0, 1)) for i in range(num_layers)
    ]
    return ids, pos, mask, spans, data, past, width


def slot_target_forward(
    target, store: SlotKV, new_tokens: list[list[int]], keep: list[list[int]], layer_ids: list[int] | None = None
) -> RaggedOutput:
    """The padded target forward over slots `0..R-1` of `store`, reading and writing the slots in place.

    Row `r`'s new tokens go to positions `len_r + j` of its own slot: the forward scatters their keys/values
    there and attends over the slots' views (`[:R, :, :max len + width]`) with a mask built on the device from
    the rows' lengths (query `j` of row `r` sees columns `≤ len_r + j`). Nothing is copied per row; the caller
    commits a row's first `n_r + 1` tokens by advancing `store.lengths[r]`, and the rest (rejected drafts,
    padding) stays beyond the length, invisible, until a later round overwrites it.

    Args:
        store ([`SlotKV`]): the rows' committed keys/values (slot `r` is row `r`).
        new_tokens (`list[list[int]]`): each row's new tokens (non-empty).
        keep (`list[list[int]]`): for each row, the offsets (within its new tokens) whose logits are needed.
        layer_ids (`list[int]`, *optional*): 0-based target layers whose outputs to return as features.

    Returns:
        [`RaggedOutput`] with `new_kv=None` (already in `store`).
    """
    device = target.device
    rows, width = len(new_tokens), max(map(len, new_tokens))
    lengths = store.lengths[:rows]
    kv_len = max(lengths) + width
    store.reserve(kv_len)
    wanted = sorted({j for row_keep in keep for j in row_keep})
    # the one host→device copy of the forward: ids, lengths and the kept logit columns in one tensor
    packed = [t for row in new_tokens for t in row + [0] * (width - len(row))] + lengths + wanted
    packed = torch.tensor(packed, device=device)
    ids = packed[: rows * width].view(rows, width)
    length = packed[rows * width : rows * width + rows]
    pos = length[:, None] + torch.arange(width, device=device)  # [R, width]
    visible = torch.arange(kv_len, device=device)[None, None, :] <= pos[:, :, None]
    float_mask = torch.zeros(visible.shape, dtype=target.dtype, device=device)
    float_mask = float_mask.masked_fill_(~visible, torch.finfo(target.dtype).min)[:, None]
    kwargs = {cache_kwarg(target): slot_cache(store.buffers(0, rows), pos, kv_len), "use_cache": True}
    column = {q: q for q in range(width)}
    if forward_accepts(target, "logits_to_keep"):
        kwargs["logits_to_keep"] = packed[rows * width + rows :]
        column = {q: i for i, q in enumerate(wanted)}
    out, feats = forward_with_features(target, layer_ids, ids, attention_mask=float_mask, position_ids=pos, **kwargs)
    logits = [out.logits[r, [column[j] for j in row_keep]] for r, row_keep in enumerate(keep)]
    features = None if feats is None else [feats[r, : len(row)] for r, row in enumerate(new_tokens)]
    return RaggedOutput(logits=logits, features=features, new_kv=None, layout="padded")


def varlen_target_forward(
    target,
    stack,
    store: SlotKV,
    slots: list[int],
    new_tokens: list[list[int]],
    keep: list[list[int]],
    layer_ids: list[int] | None = None,
) -> RaggedOutput:
    """The exact kernels' target forward over ragged rows with no padding and no mask: the rows' new tokens
    packed into one sequence of `sum(len(row))` rows for the linears, each row's queries attending to its own slot
    of `store` (its committed keys, then its new tokens causally), the new keys/values written into the slots in
    place at positions `store.lengths[slot] + j`. `stack` is [`varlen_stack`]'s (the target inside `use_kernels`
    in an exact mode). A row's logits and features are bit-identical to its tokens in the model's own forward on
    these kernels alone (the [`slot_target_forward`] / `generate()` values), whatever other rows share the call.
    The caller commits a row's first `n` tokens by advancing `store.lengths[slot]` by `n`.

    Returns:
        [`RaggedOutput`] with `new_kv=None` (already in `store`) and layout `"varlen"`.
    """
    from ..kernels.lean_model import run_varlen

    pasts = [store.lengths[s] for s in slots]
    lens = list(map(len, new_tokens))
    config = target.config.get_text_config()
    if not store.allocated:
        heads, dim = config.num_key_value_heads, getattr(config, "head_dim", None)
        dim = dim or config.hidden_size // config.num_attention_heads
        dtype = torch.bfloat16 if stack[2] else torch.float32  # exact-bf16: keys and values are bf16 values
        like = [(torch.empty(1, heads, 1, dim, dtype=dtype),) * 2] * config.num_hidden_layers
        store.reserve(max(p + n for p, n in zip(pasts, lens)), like=like)
    else:
        store.reserve(max(p + n for p, n in zip(pasts, lens)))
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    keep_rows = [starts[r] + j for r, row_keep in enumerate(keep) for j in row_keep]
    packed = [t for row in new_tokens for t in row] + [p + j for p, n in zip(pasts, lens) for j in range(n)] + keep_rows
    packed = torch.tensor(packed)  # the one host-to-tensor copy: ids, positions and kept rows
    total = starts[-1]
    logits, feats = run_varlen(
        target, stack, packed[:total], packed[total : 2 * total], slots, pasts, lens, store.buffers(0, len(store)),
        packed[2 * total :], layer_ids,
    )  # fmt: skip
    out_logits, at = [], 0
    for row_keep in keep:
        out_logits.append(logits[at : at + len(row_keep)])
        at += len(row_keep)
    features = None if feats is None else [feats[starts[r] : starts[r + 1]] for r in range(len(new_tokens))]
    return RaggedOutput(logits=out_logits, features=features, new_kv=None, layout="varlen")


def commit_rows(store: SlotKV, slots: list[int], new_kv, counts: list[int]) -> None:
    """Write the first `counts[i]` new keys/values of each row (a [`ragged_target_forward`]'s `new_kv`) into
    `store` at `slots[i]`, after the slot's committed tokens, and advance the lengths: one index-put per layer
    for all rows."""
    rows = [(s, kv, n) for s, kv, n in zip(slots, new_kv, counts) if n > 0]
    if not rows:
        return
    store.reserve(max(store.lengths[s] + n for s, _, n in rows), like=rows[0][1])
    device = rows[0][1][0][0].device
    index = [[s for s, _, n in rows for _ in range(n)], [store.lengths[s] + j for s, _, n in rows for j in range(n)]]
    slot_ids, positions = torch.tensor(index, device=device).unbind(0)  # one copy in
    layers = [
        (
            torch.cat([kv[i][0][:, :n] for _, kv, n in rows], dim=1),
            torch.cat([kv[i][1][:, :n] for _, kv, n in rows], dim=1),
        )
        for i in range(len(rows[0][1]))
    ]
    store.write_tokens(slot_ids, positions, layers)
    for s, _, n in rows:
        store.lengths[s] += n


@dataclass
class RequestSampler:
    """How one engine request turns logits into tokens: its processors, greedy or sampling, its random generator
    (at verification here, and as one row of the draft's [`PerRowSampler`]).

    Args:
        processors (`LogitsProcessorList`, *optional*): applied to draft and target logits alike (the same
            processed distribution on both sides keeps sampling exact).
        do_sample (`bool`): sample (rejection sampling at verification) or take the argmax.
        generator (`torch.Generator`, *optional*): the request's random source.
    """

    processors: object = None
    do_sample: bool = False
    generator: torch.Generator | None = None

    def process(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Processed logits `[1, V]` of the position that follows the tokens `history` (what processors such as
        the repetition penalty read); unchanged without processors."""
        if not self.processors:
            return logits
        ids = torch.tensor([history], device=logits.device)
        return self.processors(ids, logits)

    def pick(self, logits: torch.Tensor) -> int:
        """One token from processed logits `[V]`."""
        if self.do_sample:
            return int(categorical_draw(torch.softmax(logits.double(), dim=-1)[None], self.generator)[0])
        return int(logits.argmax())


def accept_row(
    sampler: RequestSampler,
    history: list[int],
    drafts: list[int],
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
) -> tuple[int, int]:
    """Verify one row: the target's logits `[ℓ+1, V]` at `[anchor, x_1..x_ℓ]` against drafts `x_1..x_ℓ`.

    Args:
        sampler ([`RequestSampler`]): the request's processors, mode and generator.
        history (`list[int]`): prompt and generated tokens up to and including the anchor.
        drafts (`list[int]`): the verified drafted tokens.
        draft_logits (`torch.Tensor` of shape `(ℓ, V)`, *optional*): the processed logits they were sampled
            from (`None` when `ℓ = 0`).
        target_logits (`torch.Tensor` of shape `(ℓ+1, V)`): raw target logits.

    Returns:
        `tuple[int, int]`: accepted drafts `n` and the target's token at position `n` (bonus/replacement).
    """
    target_logits = _processed(sampler, history, drafts, target_logits)
    if not drafts:  # nothing verified: an ordinary target step
        return 0, sampler.pick(target_logits[0])
    device = target_logits.device
    x = torch.tensor(drafts, dtype=torch.long, device=device)
    if not sampler.do_sample:
        return greedy_accept(x, target_logits)
    p = torch.softmax(target_logits.double(), dim=-1)
    q = torch.softmax(draft_logits.to(device).double(), dim=-1)
    return speculative_accept(x, q, p, generator=sampler.generator)


def accept_copy_row(
    sampler: RequestSampler, history: list[int], copy: list[int], target_logits: torch.Tensor
) -> tuple[int, int]:
    """Verify one row's deterministic proposal (a prompt-lookup copy, `dspark_hf.decoding.lookup`): position by
    position, the target's token is picked (the argmax, or a draw from its processed distribution) and compared
    with the copy; the first disagreement is the round's last token, and a copy accepted whole earns the next
    position's pick. Every emitted token is the target's own pick given the emitted prefix, so output is
    exactly the target's, greedy or sampled; the copy only decides how far the round gets.

    Args:
        sampler ([`RequestSampler`]): the request's processors, mode and generator.
        history (`list[int]`): prompt and generated tokens up to and including the anchor.
        copy (`list[int]`): the verified copied tokens.
        target_logits (`torch.Tensor` of shape `(len(copy)+1, V)`): raw target logits.

    Returns:
        `tuple[int, int]`: accepted copied tokens `n` and the target's token at position `n`.
    """
    target_logits = _processed(sampler, history, copy, target_logits)
    for i, token in enumerate(copy):
        pick = sampler.pick(target_logits[i])
        if pick != token:
            return i, pick
    return len(copy), sampler.pick(target_logits[len(copy)])


def _processed(sampler: RequestSampler, history: list[int], drafts: list[int], target_logits: torch.Tensor):
    """The target's logits `[ℓ+1, V]` through the request's processors, position `i`'s seeing the prefix
    `history + x_1..x_i` (unchanged without processors)."""
    if not sampler.processors:
        return target_logits
    seq = list(history)
    rows = []
    for i in range(len(drafts) + 1):
        rows.append(sampler.process(seq, target_logits[i : i + 1]))
        if i < len(drafts):
            seq.append(drafts[i])
    return torch.cat(rows)


def accept_greedy_rows(
    drafts: torch.Tensor | None, lengths: list[int], target_logits: list[torch.Tensor]
) -> list[tuple[int, int]]:
    """Greedy verification of rows without processors, all at once, with one host read.

    Args:
        drafts (`torch.LongTensor` of shape `(R, γ)`, *optional*): the drafted tokens on the device (`None`
            when nothing was drafted).
        lengths (`list[int]`): how many of row `r`'s drafts were verified (`ℓ_r`).
        target_logits (`list[torch.Tensor]`): row `r`'s raw target logits `[ℓ_r + 1, V]`.

    Returns:
        `list[tuple[int, int]]`: per row, the accepted drafts `n` and the target's token at position `n` (as
        [`greedy_accept`] computes it for one row).
    """
    width = max(lengths) + 1
    choice = _row_choices(target_logits, width)  # [R, width]
    if drafts is None or width == 1:
        accepted = torch.zeros(len(lengths), dtype=torch.long, device=choice.device)
    else:
        verified = (
            torch.arange(width - 1, device=choice.device)[None] < torch.tensor(lengths, device=choice.device)[:, None]
        )
        matches = (choice[:, : width - 1] == drafts[:, : width - 1].to(choice.device)) & verified
        accepted = torch.cumprod(matches.long(), dim=1).sum(dim=1)
    bonus = choice.gather(1, accepted[:, None])[:, 0]
    return [(int(n), int(t)) for n, t in torch.stack([accepted, bonus], dim=1).tolist()]  # the host read


def _row_choices(target_logits: list[torch.Tensor], width: int) -> torch.Tensor:
    """Each row's argmax per position, `[R, width]` (a row's positions past its own: any of its values). Rows that
    are slices of one contiguous logits tensor (the unpadded forward's) take one argmax over that tensor and one
    index: per row, an argmax of a `[1, V]` call costs as much as one over many rows."""
    first = target_logits[0]
    base, vocab = first._base, first.shape[-1]
    if (
        base is not None
        and base.is_contiguous()
        and base.shape[-1] == vocab
        and all(row._base is base and row.dim() == 2 and row.is_contiguous() and row.shape[0] for row in target_logits)
    ):
        flat = base.view(-1, vocab).argmax(dim=-1)
        starts = [(row.storage_offset() - base.storage_offset()) // vocab for row in target_logits]
        index = [[at + min(j, row.shape[0] - 1) for j in range(width)] for at, row in zip(starts, target_logits)]
        return flat[torch.tensor(index, device=flat.device)]
    return torch.stack([nn_pad(row.argmax(dim=-1), width) for row in target_logits])


def nn_pad(row: torch.Tensor, width: int) -> torch.Tensor:
    """A 1-D tensor right-padded with zeros to `width`."""
    return torch.nn.functional.pad(row, (0, width - row.numel()))


# ---------------------------------------------------------------------- request-level helpers
def build_processors(params) -> LogitsProcessorList | None:
    """A request's logits processors from its `SamplingParams`, in transformers' order (repetition penalty,
    then the sampling warpers, which greedy decoding ignores as `generate()` does); `None` if there are none."""

    procs = LogitsProcessorList()
    if params.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p is not None and params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
    return procs or None


def context_limit(config) -> int:
    """Longest sequence the engine lets a request reach: the position limit, and any sliding window."""
    limit = getattr(config, "max_position_embeddings", None) or 1 << 30
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    uses_window = any(t != "full_attention" for t in layer_types) or (
        not layer_types and window and getattr(config, "use_sliding_window", True)
    )
    if uses_window and window:
        # the engine's masks are full attention; within the window that is exactly what the model computes
        limit = min(limit, window)
    return int(limit)


def accept_rows(samplers, histories, block, drafted, lengths, target_logits, copied=False) -> list[tuple[int, int]]:
    """Each row's (accepted drafts, next token): greedy rows without processors all at once (one host read), the
    others one by one with their [`RequestSampler`] and history (prompt and output: what processors read). In a
    copy round (`copied`) the proposals are `drafted`, on the host; else `block` holds them (and `q`) on the device."""
    greedy = [i for i, s in enumerate(samplers) if not s.do_sample and not s.processors]
    outcomes: list[tuple[int, int] | None] = [None] * len(samplers)
    if greedy:
        tokens = None
        if copied:
            width = max(1, *(lengths[i] for i in greedy))
            padded = [drafted[i][: lengths[i]] + [0] * (width - lengths[i]) for i in greedy]
            tokens = torch.tensor(padded, device=target_logits[0].device)
        elif block is not None:
            tokens = block.tokens if len(greedy) == len(samplers) else block.tokens[greedy]
        accepted = accept_greedy_rows(tokens, [lengths[i] for i in greedy], [target_logits[i] for i in greedy])
        for i, outcome in zip(greedy, accepted):
            outcomes[i] = outcome
    for i, sampler in enumerate(samplers):
        if outcomes[i] is not None:
            continue
        q = block.logits[i, : lengths[i]] if block is not None else None
        if copied:  # a deterministic proposal: no `q`
            outcomes[i] = accept_copy_row(sampler, histories[i], drafted[i][: lengths[i]], target_logits[i])
        else:
            outcomes[i] = accept_row(sampler, histories[i], drafted[i][: lengths[i]], q, target_logits[i])
    return outcomes
