"""The draft side of one speculative round, for R rows, on the device: the one implementation both drivers call.

`generate()`'s candidate generator (`dspark_hf.decoding.generation`, R = 1) and the engine
(`dspark_hf.decoding.engine`, R rows) run the same steps, in this order:

1. [`ingest`]: project the target features of newly committed tokens into each row's draft context
   ([`KVStore`], written in place).
2. [`draft_block`]: one backbone forward over `[anchor, mask × (γ-1)]` per row → states `[R, γ, d]` and base
   logits `[R, γ, K]` over the draft vocabulary (`K = V` without a subset).
3. [`sample_block`]: the sequential head, left to right: `q_k = process(U_k + B_k(x_{k-1}))`, `x_k ~ q_k`
   (argmax when greedy), with the draft-vocabulary expansion and its fallback, and the confidence logits.
4. [`score_block`]: confidence logits → uncalibrated confidence `σ(z)`, calibrated `σ(z / T_k)`, survival
   (their running product) — the only place this math lives.
5. [`read_round`]: the round's **one** device→host copy: drafted tokens and the scores, packed in one tensor.
6. [`verified_lengths`]: the policy's lengths from the (host) survival matrix, clipped to each row's budget and
   to the first end-of-sequence token; [`round_stats`] builds each row's [`RoundStats`].

Nothing in steps 1–4 reads the device: tokens, the previous token, logits and scores stay tensors, sampling
draws by inverse CDF with an explicit `torch.Generator` (one uniform per row, [`categorical_draw`]; a
graph-captured step draws by an exponential race over noise it is given), and the "processors excluded the
whole subset" fallback is a `torch.where`, not a Python branch.
What the host must know (how many tokens to verify) comes from the single copy in step 5; the policies then
run on host data.

The guessed path (greedy, no processors) is a CPU speed-up: the sequential head's `r × K` projection of a
whole block is one matrix product along the guess "each previous token is the argmax of the base logits",
and only the positions after the first divergence are recomputed one by one. Finding the divergence is one
extra host read per round, free on a CPU (there is no asynchronous device queue to drain), so it is on by
default there and off on accelerators (`guessed_path=None`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..scheduling.policies import survival_probabilities
from .caches import KVStore, SlotKV
from .stats import RoundStats
from .verification import categorical_draw

# Processors that keep at least one finite logit of a row that has one: with only these, the draft
# vocabulary can never be excluded entirely, so the full-vocabulary fallback is never needed.
_SUBSET_SAFE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)


def may_exclude_subset(processors) -> bool:
    """Whether `processors` might set every logit of the draft vocabulary to `-inf` (decided once per call)."""
    return any(not isinstance(p, _SUBSET_SAFE_PROCESSORS) for p in processors or ())


def exponential_race(
    logits: torch.Tensor, generator: torch.Generator | None = None, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row drawn from `softmax(logits)` without a host sync. `logits`: `[R, V]` → tokens `[R]`.

    With `noise` (`[R, V]` of `Exp(1)`: a graph-captured step takes it as an input, since a traced graph cannot
    hold a generator) the draw is `argmax(p / E)`: the index of the smallest `E_i / p_i` is distributed as `p`
    (competing exponential clocks), and rows with `-inf` logits (`p_i = 0`) never win. Without it the draw is
    [`categorical_draw`] from `generator` (one uniform per row instead of `V` exponentials: on a CPU the
    race's noise cost ~0.7 ms per position over a 49k vocabulary, a seventh of a drafting round at T = 1).
    """
    probs = torch.softmax(logits.double(), dim=-1)
    if noise is None:
        return categorical_draw(probs, generator)
    return (probs / noise.to(probs.device, probs.dtype)).argmax(dim=-1)


class SharedSampler:
    """The sequential head's sampler when every row shares one set of processors and one random source:
    `generate()`'s (R = 1, transformers' processors over the running sequence `[1, T]`) and the graphed step's.
    The engine's rows each bring their own: [`PerRowSampler`].

    Args:
        processors (`LogitsProcessorList`, *optional*): the target's processors, applied to the draft alike.
        input_ids (`torch.LongTensor` of shape `(1, T)`): the sequence so far (what the processors read).
        do_sample (`bool`): exponential-race draw, else argmax.
        generator (`torch.Generator`, *optional*): the draft's random source.
        noise (`torch.Tensor` of shape `(R, γ, V)`, *optional*): `Exp(1)` noise for the block's draws, instead
            of drawing it from `generator` position by position (for a graph-captured step).
    """

    def __init__(self, processors, input_ids: torch.Tensor, do_sample: bool, generator=None, noise=None) -> None:
        self.processors = processors or None
        self.seq = input_ids
        self.do_sample = do_sample
        self.generator = generator
        self.noise = noise
        self.position = 0
        self.may_exclude_subset = may_exclude_subset(self.processors)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.processors:
            return logits
        return self.processors(self.seq, logits.to(self.seq.device)).to(logits.device)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            noise = self.noise[:, self.position] if self.noise is not None else None
            return exponential_race(logits, self.generator, noise)
        return logits.argmax(dim=-1)

    def push(self, tokens: torch.Tensor) -> None:
        self.position += 1
        if self.processors:
            self.seq = torch.cat([self.seq, tokens[:, None].to(self.seq.device)], dim=-1)


class PerRowSampler:
    """The sequential head's sampler when each row brings its own processors, mode and generator: the engine's R
    requests, each a `RequestSampler` (`dspark_hf.decoding.target_forward`). One shared set: [`SharedSampler`].

    Args:
        samplers (`list`): one `RequestSampler` (`processors`, `do_sample`, `generator`) per row.
        histories (`list[list[int]]`, *optional*): each row's prompt and output so far; needed only by rows
            with processors, whose history becomes a device tensor once per round.
        device (`torch.device`): the draft's device.
    """

    def __init__(self, samplers, histories=None, device=None) -> None:
        self.samplers = list(samplers)
        self.with_processors = [r for r, s in enumerate(self.samplers) if s.processors]
        self.seqs = {r: torch.tensor([histories[r]], device=device) for r in self.with_processors}
        self.sampling = [r for r, s in enumerate(self.samplers) if s.do_sample]
        self.may_exclude_subset = any(may_exclude_subset(self.samplers[r].processors) for r in self.with_processors)

    @property
    def processors(self) -> bool:
        return bool(self.with_processors)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.with_processors:
            return logits
        rows = list(logits.unbind(0))
        for r in self.with_processors:
            rows[r] = self.samplers[r].processors(self.seqs[r], logits[r : r + 1])[0]
        return torch.stack(rows)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        if not self.sampling:
            return tokens
        picks = list(tokens.unbind(0))
        for r in self.sampling:
            picks[r] = exponential_race(logits[r : r + 1], self.samplers[r].generator)[0]
        return torch.stack(picks)

    def push(self, tokens: torch.Tensor) -> None:
        for r in self.with_processors:
            self.seqs[r] = torch.cat([self.seqs[r], tokens[r : r + 1, None]], dim=-1)


@dataclass
class DraftedBlock:
    """A drafted block, on the device.

    Args:
        tokens (`torch.LongTensor` of shape `(R, γ)`): the drafted tokens.
        logits (`torch.Tensor` of shape `(R, γ, V)`, *optional*): the processed distributions they were drawn
            from (the `q` of verification); `None` from the compiled greedy round (`dspark_hf.decoding.compiled`),
            whose verification compares tokens only.
        confidence_logits (`torch.Tensor` of shape `(R, γ)`, *optional*): `None` without a confidence head.
    """

    tokens: torch.Tensor
    logits: torch.Tensor | None
    confidence_logits: torch.Tensor | None


@dataclass
class BlockScores:
    """Confidence → calibrated confidence → survival, `[R, γ]` each (all ones without a confidence head).

    Args:
        confidence (`torch.Tensor`): `σ(z)`, uncalibrated.
        calibrated (`torch.Tensor`): `σ(z / T_k)` with the draft's per-position temperatures.
        survival (`torch.Tensor`): `Π_{j≤k} calibrated_j`, the predicted chance that position `k` is accepted.
    """

    confidence: torch.Tensor
    calibrated: torch.Tensor
    survival: torch.Tensor


@dataclass
class HostRound:
    """What the host reads of a round, from one device→host copy ([`read_round`]): python lists per row.

    `confidence_logits`, `confidence` and `calibrated` are empty lists without a confidence head; `survival`
    is then all ones (what the policies see).
    """

    tokens: list[list[int]]
    confidence_logits: list[list[float]]
    confidence: list[list[float]]
    calibrated: list[list[float]]
    survival: list[list[float]]
    extra: list[int] = field(default_factory=list)  # token ids the read carried besides the block ([`read_round`])


# ---------------------------------------------------------------------- 1. context
@torch.no_grad()
def ingest(draft, stores, features: list[torch.Tensor], slots: list[int] | None = None) -> None:
    """Append newly committed target features (`[c_r, m·d]` per row) to each row's draft context.

    `stores` is one [`KVStore`] per row, or (the engine) one [`SlotKV`] with the rows' `slots`. Projection and
    K/V are per token (no attention), so all rows are packed into one sequence; each row's keys/values are
    written in place at its own positions.
    """
    if slots is None:
        rows = [(s, f) for s, f in zip(stores, features) if f.shape[0] > 0]
    else:
        rows = [(s, f) for s, f in zip(slots, features) if f.shape[0] > 0]
    if not rows:
        return
    device = draft.device
    context = draft.project_context(torch.cat([f for _, f in rows]).to(device)[None])
    if slots is None:
        positions = torch.cat([torch.arange(len(s), len(s) + f.shape[0], device=device) for s, f in rows])[None]
        draft.extend_context([(s, f.shape[0]) for s, f in rows], context, positions)
        return
    counts = [f.shape[0] for _, f in rows]
    starts = [stores.lengths[s] for s, _ in rows]
    index = [
        [s for (s, _), n in zip(rows, counts) for _ in range(n)],
        [p for t, n in zip(starts, counts) for p in range(t, t + n)],
    ]
    slot_ids, positions = torch.tensor(index, device=device).unbind(0)  # one copy in
    kvs = [(k[0], v[0]) for k, v in draft.context_kv(context, positions[None])]  # per layer [kv_heads, N, hd]
    stores.reserve(max(t + n for t, n in zip(starts, counts)), like=kvs)
    stores.write_tokens(slot_ids, positions, kvs)
    for (s, _), n in zip(rows, counts):
        stores.lengths[s] += n


# ---------------------------------------------------------------------- 2. backbone
def _stacked_context(stores: list[KVStore], num_layers: int, past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(stores) == 1:  # one row: views of its store, no copy
        return [tuple(t[None] for t in stores[0].layer(i)) for i in range(num_layers)]
    out = []
    for i in range(num_layers):
        pair = []
        for kv in (0, 1):
            first = stores[0].layer(i)[kv]
            buf = first.new_zeros(len(stores), first.shape[0], past, first.shape[2])
            for r, s in enumerate(stores):
                buf[r, :, : len(s)] = s.layer(i)[kv]
            pair.append(buf)
        out.append(tuple(pair))
    return out


@torch.no_grad()
def draft_block(
    draft, stores, anchors: torch.Tensor, positions: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One backbone forward over `[anchor_r, mask × (γ-1)]` for every row.

    Row `r`'s anchor sits at position `len(stores[r])` (the draft context holds every committed token);
    `stores` is one [`KVStore`] per row, or a [`SlotKV`] whose slots `0..R-1` are the rows (read as views).
    Contexts of different lengths are right-padded to the longest and masked out; the mask and positions are
    built on the device.

    Args:
        anchors (`torch.LongTensor` of shape `(R,)`): each row's last committed token, on the draft's device.
        positions (`int`, *optional*): return only the block's first `positions` positions (a length the
            policy fixed before drafting): the backbone still runs over the whole block, as in training (its
            positions attend to one another), but the LM head and everything after it run on the positions
            that can be verified only.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: final states `[R, γ', d]` and base logits `[R, γ', K]` over the draft
        vocabulary (`K = V` without a subset; see `DSparkDraftModel.draft_logits`), `γ' = min(γ, positions)`.
    """
    gamma = draft.config.block_size
    device = draft.device
    rows = len(anchors)
    if isinstance(stores, SlotKV):  # the engine: slots 0..R-1 are the rows; their views, no copy
        lengths = stores.lengths[:rows]
        past = max(lengths)
        context = stores.views(0, rows, past)
    else:
        lengths = [len(s) for s in stores]
        past = max(lengths)
        context = _stacked_context(stores, len(draft.layers), past)
    block = torch.full((rows, gamma), draft.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = anchors.to(device)
    offsets = torch.arange(gamma, device=device)
    if min(lengths) == past:  # every row sees its whole context: no mask needed
        token_positions = (offsets + past)[None].expand(rows, gamma)
        mask = None
    else:
        lens = torch.tensor(lengths, device=device)
        token_positions = lens[:, None] + offsets
        keys = torch.arange(past + gamma, device=device)
        visible = (keys[None] < lens[:, None]) | (keys[None] >= past)  # own context, and the whole block
        mask = visible[:, None, None, :].expand(rows, 1, gamma, past + gamma)
    hidden = draft.run_backbone(draft.embed_tokens(block), token_positions, context, mask)
    if positions is not None and positions < gamma:
        hidden = hidden[:, :positions]
    return hidden, draft.draft_logits(hidden)


# ---------------------------------------------------------------------- 3. sequential head
def _position(draft, sampler, h_k, base_k, prev, state):
    """One exact position for all rows → (tokens, processed logits, confidence logits, next state)."""
    head, conf_head, vocab = draft.markov_head, draft.confidence_head, draft.draft_vocab_ids
    prev_embed = head.embed(prev) if head is not None else None
    logits, state_before = base_k, state
    if head is not None:
        bias, state = head.step(h_k, prev_embed, state, vocab)
        logits = logits + bias.to(logits.dtype)
    conf = conf_head(h_k, prev_embed).float() if conf_head is not None else None
    logits = sampler.process(draft.expand_draft_logits(logits))  # [R, V]: -inf outside the draft vocabulary
    if vocab is not None and sampler.may_exclude_subset:
        # rows whose processors excluded the whole subset draw from the full vocabulary at this position
        full = sampler.process(draft.full_vocab_logits(h_k, prev_embed, state_before)).to(logits.dtype)
        empty = ~torch.isfinite(logits).any(dim=-1, keepdim=True)
        logits = torch.where(empty, full, logits)
    token = sampler.draw(logits)
    sampler.push(token)
    return token, logits, conf, state


def _guessed_block(draft, hidden, base_logits, anchors):
    """The whole block along the guessed previous tokens `[anchor, argmax U_1, …, argmax U_{γ-1}]` (greedy,
    no processors): one `r × K` projection for all positions. Returns tokens, logits, confidences, the
    guessed previous tokens and the head state after each position."""
    head, conf_head, vocab = draft.markov_head, draft.confidence_head, draft.draft_vocab_ids
    guessed = base_logits[:, :-1].argmax(dim=-1)
    if vocab is not None:
        guessed = vocab[guessed]
    prev_tokens = torch.cat([anchors[:, None], guessed], dim=1)
    features, embeds, states = head.block_features(hidden, prev_tokens)
    logits = draft.expand_draft_logits(base_logits + head.project(features, vocab).to(base_logits.dtype))
    conf = conf_head(hidden, embeds).float() if conf_head is not None else None
    return logits.argmax(dim=-1), logits, conf, prev_tokens, states


@torch.no_grad()
def sample_block(
    draft,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    anchors: torch.Tensor,
    sampler,
    guessed_path: bool | None = None,
) -> DraftedBlock:
    """The sequential head for all rows: `q_k = process(U_k + B_k(x_{k-1}))`, `x_k ~ q_k`, left to right.

    `base_logits` is `[R, γ, K]` over the draft vocabulary; each position's logits are expanded to `[R, V]`
    (`-inf` outside the subset) before the processors, so processors see token ids as usual and each token
    is drawn from exactly the processed row that is returned. Where the processors leave a row no token of
    the subset (only possible with processors outside a known-safe set), that row draws from the full
    vocabulary at that position (selected on the device).

    Args:
        hidden (`torch.Tensor` of shape `(R, γ, d)`), base_logits: from [`draft_block`].
        anchors (`torch.LongTensor` of shape `(R,)`): each row's previous token for position 0.
        sampler ([`SharedSampler`] or [`PerRowSampler`]): processors, draws and the running history.
        guessed_path (`bool`, *optional*): use the greedy guessed path (module docs); the drivers pass
            their resolved `guessed_path` option (`dspark_hf.decoding.options`); `None` is on for a CPU draft and
            off elsewhere. Only used for
            greedy rows without processors and with a sequential head.

    Returns:
        [`DraftedBlock`]
    """
    head = draft.markov_head
    rows, gamma = hidden.shape[:2]
    anchors = anchors.to(hidden.device)
    if guessed_path is None:
        guessed_path = hidden.device.type == "cpu"
    start, tokens, logits, confs = 0, [], [], []
    prev = anchors
    state = head.init_state(rows, hidden) if head is not None else None
    greedy = not getattr(sampler, "do_sample", False) and not getattr(sampler, "sampling", None)
    if guessed_path and head is not None and greedy and not sampler.processors:
        g_tokens, g_logits, g_conf, g_prev, g_states = _guessed_block(draft, hidden, base_logits, anchors)
        # position k is exact while every drafted token before it equals the guessed previous token
        diverged = (g_tokens[:, :-1] != g_prev[:, 1:]).any(dim=0)
        first = torch.where(diverged, torch.arange(1, gamma, device=hidden.device), gamma)
        start = int(first.min()) if gamma > 1 else gamma  # the guessed path's one host read
        tokens, logits = list(g_tokens[:, :start].unbind(1)), list(g_logits[:, :start].unbind(1))
        confs = list(g_conf[:, :start].unbind(1)) if g_conf is not None else []
        if start < gamma:
            prev, state = g_tokens[:, start - 1], g_states[start - 1]
    for k in range(start, gamma):
        token, q, conf, state = _position(draft, sampler, hidden[:, k], base_logits[:, k], prev, state)
        tokens.append(token)
        logits.append(q)
        if conf is not None:
            confs.append(conf)
        prev = token
    return DraftedBlock(
        tokens=torch.stack(tokens, dim=1),
        logits=torch.stack(logits, dim=1),
        confidence_logits=torch.stack(confs, dim=1) if confs else None,
    )


# ---------------------------------------------------------------------- 4-6. scores, the host read, lengths, stats
def score_block(block: DraftedBlock, temperatures: torch.Tensor) -> BlockScores:
    """`σ(z)`, `σ(z / T_k)` and their survival product (`[R, γ]`; ones without a confidence head).

    `temperatures` (`[γ]`, the draft's `calibration_temperatures`) should live on the draft's device.
    """
    confidence_logits = block.confidence_logits
    if confidence_logits is None:
        ones = torch.ones(block.tokens.shape, device=block.tokens.device)
        return BlockScores(ones, ones, ones)
    z = confidence_logits.float()
    calibrated = torch.sigmoid(z / temperatures.to(z.device)[: z.shape[-1]])
    return BlockScores(torch.sigmoid(z), calibrated, survival_probabilities(calibrated))


def read_round(block: DraftedBlock, scores: BlockScores, extra: torch.Tensor | None = None) -> HostRound:
    """The round's one device→host copy: tokens and scores packed in one float64 tensor `[R, 5γ]`, and `extra`
    (token ids on the device the host also needs this round, e.g. `generate()`'s newest tokens for prompt lookup:
    `HostRound.extra`) in the same copy."""
    parts = [block.tokens.double()]
    if block.confidence_logits is not None:
        parts += [block.confidence_logits.double(), scores.confidence.double(), scores.calibrated.double()]
    parts.append(scores.survival.double().to(block.tokens.device))
    packed = torch.cat(parts, dim=-1)
    extras: list[int] = []
    if extra is None or extra.numel() == 0:
        packed = packed.tolist()  # the host read
    else:
        rows, width = packed.shape
        flat = torch.cat([packed.flatten(), extra.to(packed.device, torch.float64)]).tolist()  # the host read
        packed = [flat[r * width : (r + 1) * width] for r in range(rows)]
        extras = [int(t) for t in flat[rows * width :]]
    gamma = block.tokens.shape[1]
    cols = [[row[i * gamma : (i + 1) * gamma] for row in packed] for i in range(len(parts))]
    tokens = [[int(t) for t in row] for row in cols[0]]
    if block.confidence_logits is None:
        return HostRound(tokens, [], [], [], cols[1], extras)
    return HostRound(tokens, cols[1], cols[2], cols[3], cols[4], extras)


def verified_lengths(policy, context, host: HostRound, budgets: list[int], eos: list[set[int]]) -> list[int]:
    """How many drafted tokens each row verifies: the policy over the budget-clipped survival matrix, then at
    most up to the first end-of-sequence token (nothing after it can be emitted).

    Runs on host data only. Sets `context.previous_survival` (what the policy saw) for the lagged policy.
    """
    survival = torch.tensor(host.survival, dtype=torch.float32)
    for i, b in enumerate(budgets):
        survival[i, b:] = 0.0
    lengths = [min(int(n), b) for n, b in zip(policy.choose_lengths(survival, context).tolist(), budgets)]
    for i, drafted in enumerate(host.tokens):
        eos_at = next((k for k, t in enumerate(drafted[: lengths[i]]) if t in eos[i]), None)
        if eos_at is not None:
            lengths[i] = eos_at + 1
    if host.confidence_logits:
        context.previous_survival = survival
    return lengths


def round_stats(host: HostRound, i: int, verified: int) -> RoundStats:
    """Row `i`'s [`RoundStats`]; `accepted` and the times are filled in by the driver."""
    has_conf = bool(host.confidence_logits)
    return RoundStats(
        drafted=host.tokens[i],
        confidence_logits=host.confidence_logits[i] if has_conf else [],
        confidence=host.confidence[i] if has_conf else [],
        calibrated_confidence=host.calibrated[i] if has_conf else [],
        survival=host.survival[i] if has_conf else [],
        verified=verified,
    )


def empty_round_stats() -> RoundStats:
    """A round that drafted nothing (no budget, or the policy skipped drafting)."""
    return RoundStats(
        drafted=[], confidence_logits=[], confidence=[], calibrated_confidence=[], survival=[], verified=0
    )
