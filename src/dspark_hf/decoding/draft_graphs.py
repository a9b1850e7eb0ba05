"""The draft step at static shapes, and its CUDA-graph capture (the `cuda_graphs` option of `generate()`).

Steps 2–4 of a round (`dspark_hf.decoding.drafting`: backbone, sequential head with sampling, confidence
scores) launch a few hundred small kernels; for a small draft on a GPU the launches, not the arithmetic, are
the cost. A CUDA graph records those launches once and replays them with one call. Replay needs fixed shapes
and fixed memory addresses, so [`padded_draft_step`] is the same step written for them:

* **the context is padded** to a power-of-two capacity `C` (at least 64 tokens) and a boolean visibility mask
  hides the padding, so the context growing by a few tokens every round does not change any shape; a new
  graph is captured only when the context outgrows its bucket (`log₂` times per request);
* **γ is fixed** (the draft's `block_size`: a round always drafts a whole block, the policy clips after);
* **R is bucketed** to a power of two (padding rows see an empty context, their outputs are dropped);
* **sampling noise is an input**: the `Exp(1)` noise of the exponential race is drawn outside the graph,
  from the request's `torch.Generator`, into a static buffer, so every round draws fresh noise (exactness)
  and a seed reproduces a call (reproducibility). Greedy rounds draw none.

The step itself *is* [`draft_block`]'s backbone followed by [`sample_block`] (`guessed_path=False`) and
[`score_block`]; only the context's shape and mask differ, so its tokens, processed logits and confidences
are those of the eager path (`tests/decoding/test_graphs.py` checks it on the CPU for every head, greedy and sampling,
with and without a draft vocabulary subset; `tests/decoding/test_compile.py`'s `fullgraph` capture covers it too).

**Why `torch.cuda.CUDAGraph` and not `torch.compile(mode="reduce-overhead")`.** A graph replays exactly the
kernels of the eager padded step, so the eager-vs-padded test on the CPU carries over to the GPU bit for bit;
Inductor would fuse and reorder reductions (other roundings than the eager path), needs Triton, and spends
minutes compiling each bucket on a first call. The static buffers are also ours: the padded draft KV is
written in place, only the newly committed tokens each round, whereas compiled CUDA-graph trees copy every
input that is not a parameter into their own buffers at each replay (the whole padded KV) unless it is marked
static, and overwrite their outputs on the next replay behind our back. `torch.compile(fullgraph=True)` stays
useful as a check that the step has no graph break (`tests/decoding/test_graphs.py`).

[`DraftStepGraphs`] runs the step for `generate()` (R = 1; written for R rows): it mirrors each row's
[`KVStore`] into the padded buffer (the new tokens only), fills the length, anchor and noise buffers, and
replays one graph per `(rows, capacity)` bucket, captured on first use after a warm-up on a side stream.
Captured graphs live beside the draft (not on it) in a bounded LRU cache ([`graph_cache`]) keyed by the sampling
mode, the logits processors' settings and the draft's weights, so later `generate()` calls reuse them.

The option `cuda_graphs` (on by default for a CUDA draft, off elsewhere) is resolved with every other option by
`dspark_hf.decoding.options.resolve_options`. When it is on but the graph path cannot run (the draft is not on a
CUDA device, a logits processor outside `TemperatureLogitsWarper` / `TopKLogitsWarper` / `TopPLogitsWarper`,
which read only the scores, or a capture that raised), the call runs the eager path and logs the reason once (a
warning); `dspark_hf.last_generation_stats(draft).cuda_graphs` says whether the graph path ran and
`cuda_graphs_fallback` why not. The greedy guessed path (a host read per round) does not apply to the graph
path.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .drafting import BlockScores, DraftedBlock, SharedSampler, sample_block, score_block

logger = logging.getLogger(__name__)

#: Processors that read only the scores (never the growing sequence, whose shape changes every round) and
#: launch no host synchronisation: they can be recorded in a graph with their settings baked in.
GRAPH_SAFE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

MIN_CAPACITY = 64  # the smallest context bucket (tokens)
MAX_GRAPHS = 8  # captured steps kept per draft (each holds its padded KV, noise buffer and memory pool)
WARMUP_STEPS = 2  # eager runs on the capture stream before capturing (lazy initialisation, cached weights)


def capacity_bucket(length: int) -> int:
    """The padded context capacity for `length` committed tokens: the next power of two, at least 64."""
    return max(MIN_CAPACITY, 1 << max(length - 1, 0).bit_length())


def rows_bucket(rows: int) -> int:
    """The padded row count for `rows` rows: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


# ---------------------------------------------------------------------- the step at static shapes
@torch.no_grad()
def padded_draft_step(
    draft,
    context: list[tuple[torch.Tensor, torch.Tensor]],
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    temperatures: torch.Tensor,
    processors=None,
    do_sample: bool = False,
    noise: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[DraftedBlock, BlockScores]:
    """Backbone + sequential head + confidence scores of one block per row, at shapes that do not change.

    The same computation as [`draft_block`] + [`sample_block`] (`guessed_path=False`) + [`score_block`]; no
    host read, no Python branch on tensor data, so it can be traced (`torch.compile(fullgraph=True)`) and
    recorded in a CUDA graph.

    Args:
        draft ([`DSparkDraftModel`]): the draft, bound to its target.
        context (`list[tuple[torch.Tensor, torch.Tensor]]`): per layer, keys and values
            `[R, kv_heads, C, head_dim]`; row `r`'s committed context is its first `lengths[r]` positions, the
            rest is padding (any finite values: it is masked out).
        lengths (`torch.LongTensor` of shape `(R,)`): each row's context length, on the draft's device.
        anchors (`torch.LongTensor` of shape `(R,)`): each row's last committed token.
        temperatures (`torch.Tensor` of shape `(γ,)`): the draft's calibration temperatures.
        processors (`LogitsProcessorList`, *optional*): applied to every row (graph-safe ones: see
            `GRAPH_SAFE_PROCESSORS`).
        do_sample (`bool`, *optional*, defaults to `False`): exponential-race draws from `noise`, else argmax.
        noise (`torch.Tensor` of shape `(R, γ, V)`, *optional*): `Exp(1)` noise, required when sampling.
        input_ids (`torch.LongTensor` of shape `(R, T)`, *optional*): what the processors read as the
            sequence; defaults to the anchors (graph-safe processors do not read it).

    Returns:
        `tuple[DraftedBlock, BlockScores]`: tokens `[R, γ]`, processed logits `[R, γ, V]`, confidence logits,
        and the confidence / calibrated / survival scores `[R, γ]`.
    """
    rows, capacity = anchors.shape[0], context[0][0].shape[2]
    gamma = draft.config.block_size
    device = anchors.device
    offsets = torch.arange(gamma, device=device)
    masks = torch.full((rows, gamma - 1), draft.config.mask_token_id, dtype=torch.long, device=device)
    block = torch.cat([anchors[:, None], masks], dim=1)
    positions = lengths[:, None] + offsets
    keys = torch.arange(capacity + gamma, device=device)
    visible = (keys[None] < lengths[:, None]) | (keys[None] >= capacity)  # own context, and the whole block
    mask = visible[:, None, None, :].expand(rows, 1, gamma, capacity + gamma)
    hidden = draft.run_backbone(draft.embed_tokens(block), positions, context, mask)
    base_logits = draft.draft_logits(hidden)
    seq = input_ids if input_ids is not None else anchors[:, None]
    sampler = SharedSampler(processors, seq, do_sample, noise=noise)
    drafted = sample_block(draft, hidden, base_logits, anchors, sampler, guessed_path=False)
    return drafted, score_block(drafted, temperatures)


# ---------------------------------------------------------------------- one captured bucket
class _Bucket:
    """Static buffers of one `(rows, capacity)` bucket, and its graph (or, `capture=False`, eager runs)."""

    def __init__(self, draft, rows: int, capacity: int, processors, do_sample: bool, capture: bool) -> None:
        config, device = draft.config, draft.device
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)
        # zeros, not empty: padding must hold finite values (a NaN key would poison the masked softmax)
        self.context = [
            (torch.zeros(shape, dtype=draft.dtype, device=device), torch.zeros(shape, dtype=draft.dtype, device=device))
            for _ in draft.layers
        ]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.anchors = torch.zeros(rows, dtype=torch.long, device=device)
        self.temperatures = torch.tensor(config.calibration_temperatures, dtype=torch.float32, device=device)
        noise_shape = (rows, config.block_size, config.vocab_size)
        self.noise = torch.ones(noise_shape, dtype=torch.float64, device=device) if do_sample else None
        self.capacity = capacity
        self.mirrored: list[tuple[weakref.ref, int] | None] = [None] * rows

        def step():
            return padded_draft_step(
                draft, self.context, self.lengths, self.anchors, self.temperatures, processors, do_sample, self.noise
            )

        self.step = step
        self.graph = None
        self.out = None
        if capture:
            self.graph, self.out = _capture(step, device)

    def load(self, stores, anchors: torch.Tensor, generator) -> None:
        """Write this round's inputs into the static buffers (device work only, no host read)."""
        rows = len(stores)
        for r, store in enumerate(stores):
            self._mirror(r, store)
            self.lengths[r].fill_(len(store))
        if rows < self.lengths.shape[0]:
            self.lengths[rows:].fill_(0)
        self.anchors[:rows].copy_(anchors)
        if self.noise is not None:
            if isinstance(generator, (list, tuple)):  # one generator per row
                for r, g in enumerate(generator):
                    self.noise[r].exponential_(generator=g)
            else:
                self.noise.exponential_(generator=generator)

    def _mirror(self, r: int, store) -> None:
        """Copy the tokens `store` gained since the last round into row `r` (all of them for a new store)."""
        previous = self.mirrored[r]
        done = previous[1] if previous is not None and previous[0]() is store else 0
        n = len(store)
        if n < done:  # the store was rewritten: copy it again
            done = 0
        if n > done:
            for i, (keys, values) in enumerate(self.context):
                store_keys, store_values = store.layer(i)
                keys[r, :, done:n].copy_(store_keys[:, done:n])
                values[r, :, done:n].copy_(store_values[:, done:n])
        self.mirrored[r] = (weakref.ref(store), n)

    def run(self, rows: int) -> tuple[DraftedBlock, BlockScores]:
        """Replay (or run) the step and return copies of its first `rows` rows (the next replay overwrites the
        graph's own outputs)."""
        if self.graph is not None:
            self.graph.replay()
            block, scores = self.out
        else:
            block, scores = self.step()

        def take(t):
            return t[:rows].clone() if t is not None else None

        return (
            DraftedBlock(take(block.tokens), take(block.logits), take(block.confidence_logits)),
            BlockScores(take(scores.confidence), take(scores.calibrated), take(scores.survival)),
        )


def _capture(step, device: torch.device):
    """Warm `step` up on a side stream, then record it on that same stream (cuBLAS and the cached weight rows
    of a draft vocabulary subset are initialised before the capture, not inside it)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    return graph, out


# ---------------------------------------------------------------------- the per-draft cache
class GraphCache:
    """Captured draft steps of one draft ([`graph_cache`]), least recently used first out.

    Entries are keyed by `(mode, rows, capacity)`; the whole cache is dropped when the draft's weights, dtype or
    device change (a graph reads the memory it was captured with). `failed` remembers modes whose capture
    raised, so later calls fall back at once. A deep copy of the draft gets an empty cache.
    """

    def __init__(self, max_entries: int = MAX_GRAPHS) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple, _Bucket] = OrderedDict()
        self.failed: dict[tuple, str] = {}
        self.weights: tuple | None = None

    def __deepcopy__(self, memo) -> GraphCache:
        return GraphCache(self.max_entries)

    def check_weights(self, draft) -> None:
        key = _weights_key(draft)
        if key != self.weights:
            self.entries.clear()
            self.failed.clear()
            self.weights = key

    def get(self, key: tuple) -> _Bucket | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: _Bucket) -> None:
        self.entries[key] = entry
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


def _weights_key(draft) -> tuple:
    """Identity, storage and in-place version of every tensor a captured step reads (the draft's parameters and
    buffers, the bound target's embedding and LM head), so any change of weights invalidates the graphs."""
    embedding, lm_head, _ = draft._require_bound()
    tensors = [*draft.parameters(), *draft.buffers(), *embedding.parameters(), *lm_head.parameters()]
    return (str(draft.device), draft.dtype, *((id(t), t.data_ptr(), t._version) for t in tensors))


#: Each draft's captured steps, beside the draft rather than on the `nn.Module`: they outlive a `generate()` call
#: (the next call replays them) and go with the draft (a weak reference: a draft that is gone frees its graphs).
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_cache(draft) -> GraphCache:
    """The draft's [`GraphCache`], made on first use (a copy of the draft gets its own)."""
    cache = _CACHES.get(draft)
    if cache is None:
        cache = _CACHES[draft] = GraphCache()
    return cache


def clear_graph_cache(draft) -> None:
    """Drop every step captured for `draft` (they are captured again on next use)."""
    _CACHES.pop(draft, None)


def _processors_key(processors) -> tuple:
    return tuple((type(p).__name__, repr(sorted(vars(p).items()))) for p in processors or ())


# ---------------------------------------------------------------------- the driver's entry point
class DraftStepGraphs:
    """The graph path of one `generate()` call: steps 2–4 of a round as one replay per round.

    Args:
        draft ([`DSparkDraftModel`]): a bound draft.
        processors (`LogitsProcessorList`, *optional*): graph-safe processors applied to every row.
        do_sample (`bool`): sampling (noise from the generator each round) or greedy.
        stats ([`GenerationStats`], *optional*): where to record that the graph path ran, or why it stopped.
        capture (`bool`, *optional*, defaults to `True`): record CUDA graphs; `False` runs the padded step
            eagerly from the same static buffers (what the CPU tests exercise).
    """

    def __init__(self, draft, processors=None, do_sample: bool = False, stats=None, capture: bool = True) -> None:
        self.draft = draft
        self.processors = processors or None
        self.do_sample = do_sample
        self.stats = stats
        self.capture = capture
        self.cache = graph_cache(draft)
        self.cache.check_weights(draft)
        config = draft.config
        self.mode = (do_sample, _processors_key(self.processors), tuple(config.calibration_temperatures), capture)
        self.disabled = False

    def run(self, stores, anchors: torch.Tensor, generator=None) -> tuple[DraftedBlock, BlockScores] | None:
        """Draft one block per row from `stores` (one [`KVStore`] per row) and `anchors` (`[R]`, on the draft's
        device); `None` when the graph path is off for this call (the capture failed: logged once)."""
        if self.disabled:
            return None
        rows = len(stores)
        key = (self.mode, rows_bucket(rows), capacity_bucket(max(len(s) for s in stores)))
        entry = self.cache.get(key)
        if entry is None:
            try:
                entry = _Bucket(self.draft, key[1], key[2], self.processors, self.do_sample, self.capture)
            except Exception as err:  # noqa: BLE001 - any capture failure falls back to the eager path
                reason = f"capturing the draft step raised {type(err).__name__}: {err}"
                self.cache.failed[self.mode] = reason
                self.disabled = True
                report_fallback(reason, explicit=True, stats=self.stats)
                return None
            self.cache.put(key, entry)
        entry.load(stores, anchors, generator)
        out = entry.run(rows)
        if self.stats is not None:
            self.stats.cuda_graphs = True
        return out


def graph_unavailable(draft, processors) -> str | None:
    """Why the graph path cannot run for this draft and these processors (`None` when it can)."""
    if draft.device.type != "cuda":
        return f"the draft is on {draft.device.type}; CUDA graphs need a CUDA device"
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    unsafe = sorted({type(p).__name__ for p in processors or () if type(p) not in GRAPH_SAFE_PROCESSORS})
    if unsafe:
        safe = ", ".join(p.__name__ for p in GRAPH_SAFE_PROCESSORS)
        return f"logits processors {unsafe} are not known to be graph-safe (only {safe} are)"
    return None


def report_fallback(reason: str, explicit: bool, stats) -> None:
    """Log once why the graph path is off (a warning where it was asked for) and record it in `stats`."""
    if stats is not None:
        stats.cuda_graphs_fallback = reason
    log = logger.warning if explicit else logger.info
    log("DSpark: CUDA graphs of the draft step are off for this call, running the eager path: %s.", reason)
