"""The batched building blocks of [`DSparkEngine`]: ragged target forwards, batched drafting, per-row acceptance.

Everything here works on *rows* (one per active request) whose lengths differ, and is free of scheduling
and request bookkeeping (that is `dspark_hf.decoding.engine`):

* [`KVStore`] holds one request's keys/values (target or draft), one `[kv_heads, T, head_dim]` pair per
  layer, in buffers that grow by doubling up to the request's reservation, so memory stays bounded by it.
* [`ragged_target_forward`] runs ONE target forward over all rows, each with its own cached context and its
  own number of new tokens, in one of two layouts:

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
* [`draft_ingest`] projects newly committed target features into each request's draft context (packed, no
  attention); [`draft_block`] runs the draft backbone for all rows at once (the draft's queries are always
  γ per row, so only its context is padded).
* [`sample_block`] is the sequential head, vectorised over rows, with each request's logits processors and
  random generator; [`accept_row`] applies greedy or rejection-sampling acceptance
  (`dspark_hf.decoding.verification`) to one row. With a draft vocabulary subset (`draft.set_draft_vocab`) both
  compute logits over the subset only, and `sample_block` expands them to the full vocabulary (`-inf`
  outside the subset) before the processors, exactly as `generate()` does.
* [`build_processors`] and [`context_limit`] turn a request's sampling parameters and the target's config
  into the processors and the length cap the rows above use.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..model.configuration import hidden_state_indices
from .generation import _HIDDEN_STATES_BY_INDEX
from .verification import greedy_accept, speculative_accept

LAYOUTS = ("padded", "packed", "auto")


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


def _zip_old(old: list[torch.Tensor], kvs: list) -> list:
    return list(zip(old if old else [None] * len(kvs), kvs))


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


def _filled_cache(data: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A `DynamicCache` holding `data` (one `(keys, values)` per layer) without copying it.

    `DynamicCache(ddp_cache_data=...)` would concatenate every tensor onto an empty one (a full copy of the
    batch's KV each round); handing the tensors to the layers directly avoids that. Falls back to the
    copying constructor if a transformers release stores layer tensors differently.
    """
    if not data:
        return DynamicCache()
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in data])
    for layer, (k, v) in zip(cache.layers, data):
        layer.keys, layer.values = k, v
    if cache.get_seq_length() != data[0][0].shape[-2]:
        return DynamicCache(ddp_cache_data=data)
    return cache


def _cache_kwarg(target) -> str:
    # transformers renamed `past_key_values` to `cache` (the old name warns in 5.24)
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


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
    rows = len(new_tokens)
    lengths = [len(s) for s in stores]
    counts = [len(t) for t in new_tokens]
    if layout == "auto":
        cost = linear_cost if linear_cost is not None else linear_cost_in_keys(target)
        layout = choose_layout(lengths, counts, cost)
    filled = next((s for s in stores if len(s)), None)
    num_layers = len(filled._keys) if filled is not None else 0

    def layer_kv(store: KVStore, i: int, kv: int) -> torch.Tensor:  # an empty store contributes nothing
        return store.layer(i)[kv] if len(store) else filled.layer(i)[kv][:, :0]

    if layout == "padded":
        past, width = max(lengths), max(counts)
        ids = torch.zeros(rows, width, dtype=torch.long)
        pos = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, 1, width, past + width, dtype=torch.bool)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        spans = []  # (batch row, first query, end query); a row's new keys sit at `past + query`
        for r in range(rows):
            n, t = counts[r], lengths[r]
            ids[r, :n] = torch.tensor(new_tokens[r])
            pos[r, :n] = torch.arange(t, t + n)
            mask[r, 0, :n, :t] = True
            mask[r, 0, :n, past : past + n] = causal[:n, :n]
            mask[r, 0, n:, past + n :] = torch.eye(width - n, dtype=torch.bool)  # padding sees only itself
            spans.append((r, 0, n))
        data = [
            tuple(_pad_stack([layer_kv(s, i, kv) for s in stores], past) for kv in (0, 1)) for i in range(num_layers)
        ]
    else:
        past, width = sum(lengths), sum(counts)
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
        data = [
            tuple(torch.cat([layer_kv(s, i, kv) for s in stores], dim=1)[None] for kv in (0, 1))
            for i in range(num_layers)
        ]
    cache = _filled_cache(data)
    kwargs = {_cache_kwarg(target): cache, "use_cache": True}
    if layer_ids:
        kwargs["output_hidden_states"] = hidden_state_indices(layer_ids) if _HIDDEN_STATES_BY_INDEX else True
    # Only the logits the caller needs go through the LM head (a prefill row needs just its last position).
    # `logits_to_keep` selects query positions shared by all batch rows.
    wanted = sorted({q0 + j for (_, q0, _), row_keep in zip(spans, keep) for j in row_keep})
    column = {q: q for q in range(width)}
    if "logits_to_keep" in inspect.signature(target.forward).parameters:
        kwargs["logits_to_keep"] = torch.tensor(wanted, device=device)
        column = {q: i for i, q in enumerate(wanted)}
    # additive float mask (works for eager and SDPA attention alike): a large negative value where masked
    float_mask = torch.zeros(mask.shape, dtype=target.dtype).masked_fill_(~mask, torch.finfo(target.dtype).min)
    out = target(ids.to(device), attention_mask=float_mask.to(device), position_ids=pos.to(device), **kwargs)
    logits = [out.logits[b, [column[q0 + j] for j in row_keep]] for (b, q0, _), row_keep in zip(spans, keep)]
    features = None
    if layer_ids:
        feats = torch.cat([out.hidden_states[i] for i in hidden_state_indices(layer_ids)], dim=-1)
        features = [feats[b, q0:q1] for b, q0, q1 in spans]
    new_kv = [
        [(layer.keys[b, :, past + q0 : past + q1], layer.values[b, :, past + q0 : past + q1]) for layer in cache.layers]
        for b, q0, q1 in spans
    ]
    return RaggedOutput(logits=logits, features=features, new_kv=new_kv, layout=layout)


# ---------------------------------------------------------------------- draft side
@torch.no_grad()
def draft_ingest(draft, stores: list[KVStore], features: list[torch.Tensor]) -> None:
    """Append newly committed target features (`[c_r, m·d]` per row) to each row's draft context.

    Projection and K/V are per token (no attention), so all rows are packed into one sequence.
    """
    rows = [(s, f) for s, f in zip(stores, features) if f.shape[0] > 0]
    if not rows:
        return
    device = draft.device
    context = draft.project_context(torch.cat([f for _, f in rows]).to(device)[None])
    positions = torch.cat([torch.arange(len(s), len(s) + f.shape[0]) for s, f in rows])[None].to(device)
    kvs = draft.context_kv(context, positions)  # per layer ([1, kv_heads, Σc, hd], ...)
    offset = 0
    for store, feats in rows:
        c = feats.shape[0]
        store.append([(k[0, :, offset : offset + c], v[0, :, offset : offset + c]) for k, v in kvs])
        offset += c


@torch.no_grad()
def draft_block(draft, stores: list[KVStore], anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched backbone forward over `[anchor_r, mask × (γ-1)]` for every row.

    Row `r`'s anchor sits at position `len(stores[r])` (the draft context holds every committed token).
    Contexts are right-padded to the longest and masked out.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: final states `[R, γ, d]` and base logits `[R, γ, K]` over the draft
        vocabulary (`K = V` without a subset; see `DSparkDraftModel.draft_logits`).
    """
    gamma = draft.config.block_size
    device = draft.device
    rows = len(anchors)
    lengths = [len(s) for s in stores]
    past = max(lengths)
    context = [
        tuple(_pad_stack([s.layer(i)[kv] for s in stores], past) for kv in (0, 1)) for i in range(len(draft.layers))
    ]
    mask = torch.ones(rows, 1, gamma, past + gamma, dtype=torch.bool)
    for r, t in enumerate(lengths):
        mask[r, :, :, t:past] = False
    block = torch.full((rows, gamma), draft.config.mask_token_id, dtype=torch.long)
    block[:, 0] = torch.tensor(anchors)
    positions = torch.tensor(lengths)[:, None] + torch.arange(gamma)
    hidden = draft.run_backbone(draft.embed_tokens(block.to(device)), positions.to(device), context, mask.to(device))
    return hidden, draft.draft_logits(hidden)


@dataclass
class RowSampler:
    """How one request turns logits into tokens: its processors, greedy or sampling, its random generator.

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
            probs = torch.softmax(logits.double(), dim=-1)
            return int(torch.multinomial(probs, 1, generator=self.generator))
        return int(logits.argmax())


@torch.no_grad()
def sample_block(
    draft,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    anchors: list[int],
    samplers: list[RowSampler],
    histories: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sequential head for all rows: `q_k = process(U_k + B_k(x_{k-1}))`, `x_k ~ q_k`, left to right.

    The head's step is batched over rows; processors and sampling run per row (each request has its own).
    `base_logits` is `[R, γ, K]` over the draft vocabulary; each position's logits are expanded to `[R, V]`
    (`-inf` outside the subset) before the processors, and a row the processors leave without any token of
    the subset falls back to the full vocabulary at that position.

    Returns:
        `tuple`: drafted tokens `[R, γ]`, processed draft logits `[R, γ, V]` (the `q` of verification) and
        confidence logits `[R, γ]` (`None` without a confidence head).
    """
    head, conf_head = draft.markov_head, draft.confidence_head
    vocab = draft.draft_vocab_ids
    rows, gamma = hidden.shape[:2]
    device = draft.device
    prev = torch.tensor(anchors, device=device)
    state = head.init_state(rows, hidden) if head is not None else None
    seqs = [list(h) for h in histories]
    tokens, logits_out, conf_out = [], [], []
    for k in range(gamma):
        h_k = hidden[:, k]
        prev_embed = head.embed(prev) if head is not None else None
        logits, state_before = base_logits[:, k], state
        if head is not None:
            bias, state = head.step(h_k, prev_embed, state, vocab)
            logits = logits + bias.to(logits.dtype)
        if conf_head is not None:
            conf_out.append(conf_head(h_k, prev_embed).float())
        logits = draft.expand_draft_logits(logits)  # [R, V]: -inf outside the draft vocabulary
        if any(s.processors for s in samplers):
            logits = torch.cat([s.process(seq, logits[r : r + 1]) for r, (s, seq) in enumerate(zip(samplers, seqs))])
        if vocab is not None:  # rows whose processors excluded the whole subset: full vocabulary there
            for r in (~torch.isfinite(logits).any(dim=-1)).nonzero()[:, 0].tolist():
                row_state = state_before[r : r + 1] if state_before is not None else None
                embed_r = prev_embed[r : r + 1] if prev_embed is not None else None
                full = draft.full_vocab_logits(h_k[r : r + 1], embed_r, row_state)
                logits[r] = samplers[r].process(seqs[r], full)[0].to(logits.dtype)
        if any(s.do_sample for s in samplers):
            picked = [s.pick(logits[r]) for r, s in enumerate(samplers)]
        else:
            picked = logits.argmax(dim=-1).tolist()
        for seq, t in zip(seqs, picked):
            seq.append(t)
        prev = torch.tensor(picked, device=device)
        tokens.append(prev)
        logits_out.append(logits)
    conf = torch.stack(conf_out, dim=1) if conf_out else None
    return torch.stack(tokens, dim=1), torch.stack(logits_out, dim=1), conf


def accept_row(
    sampler: RowSampler,
    history: list[int],
    drafts: list[int],
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
) -> tuple[int, int]:
    """Verify one row: the target's logits `[ℓ+1, V]` at `[anchor, x_1..x_ℓ]` against drafts `x_1..x_ℓ`.

    Args:
        sampler ([`RowSampler`]): the request's processors, mode and generator.
        history (`list[int]`): prompt and generated tokens up to and including the anchor.
        drafts (`list[int]`): the verified drafted tokens.
        draft_logits (`torch.Tensor` of shape `(ℓ, V)`, *optional*): the processed logits they were sampled
            from (`None` when `ℓ = 0`).
        target_logits (`torch.Tensor` of shape `(ℓ+1, V)`): raw target logits.

    Returns:
        `tuple[int, int]`: accepted drafts `n` and the target's token at position `n` (bonus/replacement).
    """
    if sampler.processors:  # position i's processors see the prefix history + x_1..x_i
        seq = list(history)
        rows = []
        for i in range(len(drafts) + 1):
            rows.append(sampler.process(seq, target_logits[i : i + 1]))
            if i < len(drafts):
                seq.append(drafts[i])
        target_logits = torch.cat(rows)
    if not drafts:  # nothing verified: an ordinary target step
        return 0, sampler.pick(target_logits[0])
    device = target_logits.device
    x = torch.tensor(drafts, dtype=torch.long, device=device)
    if not sampler.do_sample:
        return greedy_accept(x, target_logits)
    p = torch.softmax(target_logits.double(), dim=-1)
    q = torch.softmax(draft_logits.to(device).double(), dim=-1)
    return speculative_accept(x, q, p, generator=sampler.generator)


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
