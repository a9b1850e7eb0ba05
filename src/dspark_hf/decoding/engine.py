"""`DSparkEngine`: many concurrent requests, continuous batching, one batched verification forward per round.

A round ([`DSparkEngine.step`]) does, for all active requests at once:

1. **admit** queued requests while fewer than `max_batch_size` are active and their KV reservations
   (prompt + `max_new_tokens`) fit in `max_tokens`; a newly admitted request gets its **prefill** (one
   batched target forward over the new prompts, no drafts) and its first token;
2. **draft**: with prompt lookup on, first a search of each request's context for a copy; a round in which
   some request has one (and it pays) verifies the copies instead of drafting (`lookup` below). Otherwise one
   batched draft-backbone forward for every decoding request, then the sequential head (batched over
   requests, each request's own logits processors and random generator);
3. **schedule**: the verification policy sees the whole batch's survival matrix `[R, γ]` (and the target's
   SPS profile) and picks each request's verification length `ℓ_r`;
4. **verify**: ONE target forward over the ragged rows `[anchor_r, x_1..x_ℓ_r]` (padded or packed, see
   `dspark_hf.decoding.engine_batch`), then per-request acceptance (greedy, or exact rejection sampling);
5. **commit**: each request's length in its KV slot advances by its committed tokens (rejected drafts stay
   beyond it, masked, until overwritten: that is the rollback), their target features wait for the draft's
   next drafting round (a round that does not draft never runs the draft), and accepted tokens are emitted
   with incrementally decoded text. Finished requests free their reservations, which lets queued ones in.

Every active request owns one slot of two preallocated stores (`dspark_hf.decoding.caches.SlotKV`, target
and draft): the padded verification forward reads the batch's past as views and writes new keys/values in
place at each row's own positions, with masks and positions built on the device from the rows' lengths.

Exactness does not depend on batching: every request sees exactly its own context (masks and position
ids), so greedy output equals plain `generate()` on that prompt alone and sampling follows the target's
distribution (`tests/test_engine.py`, `tests/test_engine_sampling.py`, `tests/test_engine_lookup.py`).

Example:

```python
>>> from dspark_hf import DSparkEngine, SamplingParams
>>> engine = DSparkEngine(target, draft, tokenizer, policy="hardware_aware_lagged", max_batch_size=16)
>>> outs = engine.generate(["Hi!", [{"role": "user", "content": "2+2?"}]], SamplingParams(max_new_tokens=64))
>>> outs[0].text, outs[0].summary()["tau"], engine.metrics.to_prometheus()
```
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..kernels import build_exact_kernels, use_kernels
from ..scheduling.policies import ScheduleContext, uniform_length
from . import draft_graphs
from .caches import SlotKV, SlotRow
from .drafting import (
    RowsSampler,
    draft_block,
    empty_round_stats,
    ingest,
    read_round,
    round_stats,
    sample_block,
    score_block,
    verified_lengths,
)
from .engine_batch import (
    LAYOUTS,
    RowSampler,
    accept_copy_row,
    accept_greedy_rows,
    accept_row,
    build_processors,
    choose_layout,
    commit_rows,
    context_limit,
    linear_cost_in_keys,
    ragged_target_forward,
    slot_target_forward,
)
from .lookup import LookupGate, LookupIndex
from .metrics import EngineMetrics
from .options import resolve_options
from .stats import GenerationStats

logger = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """How one request is decoded.

    Args:
        max_new_tokens (`int`, *optional*, defaults to 64): tokens to generate at most.
        do_sample (`bool`, *optional*, defaults to `False`): sample (exact rejection sampling) or greedy.
        temperature (`float`, *optional*, defaults to 1.0): sampling temperature (ignored when greedy).
        top_k (`int`, *optional*): keep the `top_k` most likely tokens (sampling only).
        top_p (`float`, *optional*): nucleus sampling mass (sampling only).
        repetition_penalty (`float`, *optional*): as in transformers (greedy and sampling).
        eos_token_id (`int` or `list[int]`, *optional*): stop tokens; defaults to the target's
            `generation_config.eos_token_id`.
        ignore_eos (`bool`, *optional*, defaults to `False`): never stop at an EOS token.
        seed (`int`, *optional*): seed of the request's random generator (default: drawn from torch's global
            generator when the request is added, so `torch.manual_seed` makes runs reproducible).
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: int | list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class RequestOutput:
    """The result of one request.

    Args:
        request_id (`int`): the id [`DSparkEngine.add_request`] returned.
        prompt_token_ids (`list[int]`): the tokenized prompt (empty if it could not be built).
        token_ids (`list[int]`): generated tokens (the EOS token included when generation stopped there).
        text (`str`, *optional*): `token_ids` decoded (with the engine's tokenizer, special tokens skipped).
        finish_reason (`str`): `"eos"`, `"length"` (`max_new_tokens`), `"context"` (the target's context
            is full) or `"error"`.
        error (`str`, *optional*): why the request was refused (the other requests are not affected).
        stats ([`GenerationStats`], *optional*): the request's speculative rounds (τ, lengths, acceptance).
        times (`dict[str, float]`): `perf_counter` stamps `added`, `admitted`, `first_token`, `finished`.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    finish_reason: str = "length"
    error: str | None = None
    stats: GenerationStats | None = None
    times: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """`bool`: whether the request ran (no error)."""
        return self.error is None

    def summary(self) -> dict:
        """Per-request statistics: τ, mean verification length, acceptance per position, tokens/s, latencies."""
        t = self.times
        out = {"request_id": self.request_id, "new_tokens": len(self.token_ids), "finish_reason": self.finish_reason}
        if self.stats is not None:
            out.update(
                rounds=self.stats.num_rounds,
                tau=self.stats.tau,
                mean_verification_length=self.stats.mean_verified,
                acceptance_by_position=self.stats.acceptance_by_position,
            )
        if "finished" in t and "admitted" in t:
            busy = t["finished"] - t["admitted"]
            out.update(
                queue_seconds=t["admitted"] - t["added"],
                time_to_first_token=t.get("first_token", t["finished"]) - t["added"],
                latency_seconds=t["finished"] - t["added"],
                tokens_per_second=len(self.token_ids) / busy if busy > 0 else math.nan,
            )
        return out


@dataclass
class StreamEvent:
    """Tokens accepted for one request in one round (what [`DSparkEngine.stream`] yields).

    Args:
        request_id (`int`): the request.
        token_ids (`list[int]`): newly accepted tokens (may be empty for a finished, failed request).
        text (`str`, *optional*): their text (the decoded difference), with a tokenizer.
        finished (`bool`): whether the request is done; then `output` holds its [`RequestOutput`].
        output ([`RequestOutput`], *optional*): the final result, on the last event of a request.
    """

    request_id: int
    token_ids: list[int]
    text: str | None = None
    finished: bool = False
    output: RequestOutput | None = None


@dataclass
class _Request:
    """Engine-side state of one request (not part of the public API)."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    sampler: RowSampler
    eos: set[int]
    max_new: int
    reserve: int
    times: dict[str, float]
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)
    kv: SlotRow | None = None  # the request's slot in the engine's target KV (and `dkv` in the draft's)
    dkv: SlotRow | None = None
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not yet in the draft's context
    text_done: int = 0  # tokens whose text has been streamed (incremental detokenisation)
    text_prefix: int = 0  # where the decoded window starts (the previous call's `text_done`)
    text_len: int = 0  # characters streamed
    text: str | None = None  # the whole output's text, once finished
    finish_reason: str | None = None
    lookup: LookupIndex | None = None  # the n-gram index of prompt + output, with prompt lookup on

    @property
    def pending_tokens(self) -> int:
        return sum(f.shape[0] for f in self.pending)


class DSparkEngine:
    """Serve many requests at once with a DSpark draft: continuous batching, batch-wide verification scheduling.

    Args:
        target (`PreTrainedModel`): the causal LM; every layer must use full attention (a sliding window caps
            the request length at the window).
        draft ([`DSparkDraftModel`], *optional*): the draft, bound to `target` if it is not. `None` (or
            `policy="none"`) decodes without speculation through the same batched machinery.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): needed for text and chat-message prompts and for
            `RequestOutput.text`.
        policy (`str` or [`VerificationPolicy`], *optional*): see [`resolve_policy`]; `"none"` disables
            drafting. Like every option below, resolved by `dspark_hf.decoding.options.resolve_options` with the
            one precedence of every driver: this argument, then the draft's own default (its
            `generation_config.json`), then the library's (`hardware_aware_uniform` for a calibrated draft, else
            `fixed`, the whole block).
        max_batch_size (`int`, *optional*, defaults to 8): most requests decoded at once.
        max_tokens (`int`, *optional*): KV budget in tokens; a request reserves `prompt + max_new_tokens`
            while active. Defaults to `max_batch_size ×` the target's context length.
        layout (`str`, *optional*, defaults to `"auto"`): layout of the ragged target forwards: `"padded"`,
            `"packed"`, or `"auto"` to pick the cheaper per forward from a cost model (see
            `dspark_hf.decoding.engine_batch` and `docs/engine.md` for which is faster where).
        sps ([`SPSProfile`], *optional*): the target's SPS profile for hardware-aware policies; measured and
            cached on first use if needed and not given.
        kernels (`str`, *optional*): the CPU kernel mode of the target's (and draft's) forwards, with or
            without speculation (see `dspark_hf.kernels`): `"stock"`, `"packed"` or `"exact"`. In
            `"exact"` every row of every decoding round is computed exactly as a one-row forward computes it,
            so a request's greedy output is token-identical *by construction* to plain `generate()` on the
            same kernels (`dspark_kernels="exact"`) for prompts of up to `EXACT_MAX_ROWS` (512) tokens (a
            longer prompt's prefill runs the stock kernels, in the engine and in `generate()` alike, at
            different shapes); the rounds run the padded layout. Defaults to the draft's own default, then the
            library's. The models are switched while the engine has work and switched back when it is idle.
        cuda_graphs (`bool`, *optional*): run the draft step (backbone, sequential head, confidence) as a
            captured CUDA graph in rounds whose rows are all greedy without logits processors (other rounds run
            it eagerly); unset, the draft's default, else on for a CUDA draft. See `dspark_hf.decoding.draft_graphs`
            (when capture is impossible the engine logs why and runs eagerly).
        compiled (`bool`, *optional*): run the drafting round as compiled calls where that backend is eligible;
            unset, the draft's default, else on.
        lookup (`bool`, `int`, `str` or [`LookupConfig`], *optional*): prompt lookup as a second proposer
            (`dspark_hf.decoding.lookup`), as in `generate()`: a round in which some requests' last tokens recur
            in their own context verifies those requests' copies (the others take a plain step in it) and does
            not draft; the policy neither plans nor observes such a round. A copy widens a padded forward for
            every row, so with an SPS profile the round verifies the copy length that pays on it (or none), and
            a [`LookupGate`] measures, per batch size, whether copy rounds emit more per second than the others
            and stops copying where they do not. Unset, the draft's default, else off; always off without
            speculation.

    The resolved options are `engine.options` ([`SpeculationOptions`]).
    """

    def __init__(
        self,
        target,
        draft=None,
        tokenizer=None,
        policy=None,
        max_batch_size: int = 8,
        max_tokens: int | None = None,
        layout: str = "auto",
        sps=None,
        cuda_graphs: bool | None = None,
        kernels: str | None = None,
        lookup=None,
        compiled: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
        self.target, self.tokenizer, self.layout = target, tokenizer, layout
        self._linear_cost = linear_cost_in_keys(target)
        self.max_batch_size = max_batch_size
        config = target.config.get_text_config()
        self.vocab_size = config.vocab_size
        self.context_limit = context_limit(config)
        self.max_tokens = max_tokens if max_tokens is not None else max_batch_size * min(self.context_limit, 1 << 20)
        self.speculate = draft is not None and policy != "none"
        self.draft = draft if self.speculate else None
        self.gamma = draft.config.block_size if self.speculate else 0
        self.schedule_context = ScheduleContext()
        call = {
            "policy": policy,
            "lookup": lookup,
            "cuda_graphs": cuda_graphs,
            "kernels": kernels,
            "compiled": compiled,
        }
        if not self.speculate:
            call = {"kernels": kernels}
        self.options = resolve_options(self.draft, target, call=call)
        self.policy, self.lookup, kernels = self.options.policy, self.options.lookup, self.options.kernels
        if kernels == "exact" and layout == "packed":
            raise ValueError(
                "layout='packed' puts every row in one sequence, which the exact kernels treat as one long "
                "sequence (a prefill, on stock kernels) once it passes EXACT_MAX_ROWS tokens; use layout='padded' "
                "or 'auto' (the exact mode runs padded), or name other kernels (kernels='stock'): the exact ones are "
                "the library's default for a float32 CPU target."
            )
        self.kernels = kernels
        self.cpu_packing = kernels == "packed"
        if kernels == "exact":
            self.layout = "padded"  # one row per request: each request's tokens are its own sequence
            build_exact_kernels()  # now (a minute on first use, then cached), not inside the first request's round
        self._kernel_scope: contextlib.ExitStack | None = None  # the kernel mode, held while there is work
        if self.speculate:
            if draft.bound_target is not target:
                draft.bind_target(target)
            if self.policy.needs_sps and getattr(self.policy, "sps", None) is None:
                if sps is None:
                    from ..scheduling.sps import get_sps_profile

                    with use_kernels(target, mode=self.kernels):  # measured on the kernels it will run
                        sps = get_sps_profile(target)
                self.schedule_context.sps = sps.sps
            self.temperatures = torch.tensor(
                draft.config.calibration_temperatures, dtype=torch.float32, device=draft.device
            )
        self.lookup_gate = LookupGate() if self.lookup is not None else None
        self.graphs = self._draft_graphs(self.options.cuda_graphs) if self.speculate else None
        self.graph_rounds = 0  # rounds whose draft step ran on the graph path
        self.layer_ids = list(draft.config.target_layer_ids) if self.speculate else None
        self.metrics = EngineMetrics(block_size=max(self.gamma, 1))
        self._queue: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._failed: list[RequestOutput] = []
        self._reserved = 0
        # every active request owns one slot (batch row) of these preallocated stores, written in place
        self._kv = SlotKV(max_batch_size)
        self._dkv = SlotKV(max_batch_size) if self.speculate else None
        self._ids = itertools.count()
        self._buffered: list[StreamEvent] = []  # events of requests not owned by a running generate()/stream()

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Never raises for a bad request: its result carries the error.

        Args:
            prompt: token ids (`list[int]` or a 1-D / `[1, T]` tensor), a string, or chat messages
                (`list[dict]` with `role`/`content`, rendered with the tokenizer's chat template).
            sampling_params ([`SamplingParams`], *optional*): defaults to greedy, 64 new tokens.
        """
        params = sampling_params or SamplingParams()
        rid = next(self._ids)
        times = {"added": time.perf_counter()}
        self.metrics.requests_added += 1
        ids: list[int] = []
        try:
            ids = self._tokenize(prompt)
            req = self._make_request(rid, ids, params, times)
        except (ValueError, TypeError) as err:
            self._failed.append(
                RequestOutput(rid, ids, [], finish_reason="error", error=f"request {rid}: {err}", times=times)
            )
            return rid
        self._queue.append(req)
        return rid

    def cancel(self, request_id: int) -> bool:
        """Drop a queued or active request now: its KV reservation and caches are freed before the next round.

        No event is emitted for a cancelled request (an undelivered result of it is discarded too). Like every
        other method, call it from the thread that calls [`step`] (the engine is not thread-safe).

        Args:
            request_id (`int`): the id [`add_request`] returned.

        Returns:
            `bool`: whether the request was still unfinished (`False` for an unknown or finished id).
        """
        for req in self._queue:
            if req.rid == request_id:
                self._queue.remove(req)
                return True
        for req in self._active:
            if req.rid == request_id:
                self._release(req)
                return True
        pending = len(self._failed) + len(self._buffered)
        self._failed = [o for o in self._failed if o.request_id != request_id]
        self._buffered = [e for e in self._buffered if e.request_id != request_id]
        return len(self._failed) + len(self._buffered) < pending

    def release_kernels(self) -> None:
        """Switch the models back from the engine's kernel mode now (the next round with work switches them again).

        The engine does this itself whenever a round leaves it idle; call it after abandoning an engine that still
        holds requests, so that the target's other users get their own kernels back.
        """
        scope, self._kernel_scope = self._kernel_scope, None
        if scope is not None:
            scope.close()

    def has_unfinished(self) -> bool:
        """`bool`: whether any request is queued, active or has an undelivered result."""
        return bool(self._queue or self._active or self._failed or self._buffered)

    @property
    def queue_length(self) -> int:
        """`int`: requests waiting for admission."""
        return len(self._queue)

    @torch.no_grad()
    def step(self) -> list[StreamEvent]:
        """Run one round (admissions and prefills, then one drafting + verification round) and return its events."""
        start = time.perf_counter()
        events, self._buffered = self._buffered, []
        for out in self._failed:
            self.metrics.requests_finished += 1
            self.metrics.requests_failed += 1
            events.append(StreamEvent(out.request_id, [], finished=True, output=out))
        self._failed = []
        self._compact()
        decoding = list(self._active)  # slots 0..R-1, in order
        admitted = self._admit()
        if (decoding or admitted) and self._kernel_scope is None and self.kernels != "stock":
            # switching a model's kernels walks its modules (milliseconds): done once per busy period, not per round
            self._kernel_scope = contextlib.ExitStack()
            self._kernel_scope.enter_context(use_kernels(self.target, self.draft, mode=self.kernels))
        if decoding:
            self._decode_round(decoding, events)
        if admitted:
            self._prefill(admitted, events)
        self._compact()  # finished requests' slots (and, when idle, the buffers) are given back now
        if not self._active and not self._queue:
            self.release_kernels()
        m = self.metrics
        m.busy_seconds += time.perf_counter() - start
        kv_bytes = self._kv.nbytes + (self._dkv.nbytes if self._dkv is not None else 0)
        m.record_gauges(len(self._active), len(self._queue), sum(len(r.kv) for r in self._active), kv_bytes)
        return events

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        """Submit `prompts` and yield their [`StreamEvent`]s as tokens are accepted, until all are finished.

        Events of other requests (added with [`add_request`]) are kept for the next [`step`] call.
        """
        prompts = list(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, _per_prompt(sampling_params, len(prompts)))]
        pending = set(ids)
        while pending:
            for event in self.step():
                if event.request_id in pending:
                    if event.finished:
                        pending.discard(event.request_id)
                    yield event
                else:
                    self._buffered.append(event)

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Run `prompts` to completion (continuously batched) and return their results in order.

        Args:
            prompts (`list`): each a token-id list/tensor, a string or chat messages (see [`add_request`]).
            sampling_params ([`SamplingParams`] or `list[SamplingParams]`, *optional*): one for all, or one per
                prompt.

        Returns:
            `list[RequestOutput]`: in the order of `prompts`; failed requests carry `error`.
        """
        outputs = {}
        for event in self.stream(prompts, sampling_params):
            if event.finished:
                outputs[event.request_id] = event.output
        return [outputs[k] for k in sorted(outputs)]

    # ------------------------------------------------------------------ request intake
    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1:
                raise ValueError(f"a tensor prompt must be 1-D or [1, T], got shape {tuple(prompt.shape)}.")
            return prompt.tolist()
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise ValueError("text and chat-message prompts need a tokenizer: DSparkEngine(..., tokenizer=tok).")
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt)["input_ids"])
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
            return list(ids[0] if ids and isinstance(ids[0], list) else ids)
        if isinstance(prompt, Iterable):
            ids = list(prompt)
            if not all(isinstance(t, int) for t in ids):
                raise TypeError("a prompt list must hold token ids (int) or chat messages (dict).")
            return ids
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}: use token ids, a string or chat messages.")

    def _make_request(self, rid: int, ids: list[int], params: SamplingParams, times: dict) -> _Request:
        if not ids:
            raise ValueError("the prompt is empty; give at least one token (the target needs a context).")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the target's vocabulary 0..{self.vocab_size - 1}.")
        if len(ids) >= self.context_limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the target's context holds {self.context_limit}; shorten it "
                "so at least one token can be generated."
            )
        _check_params(params)
        max_new = min(params.max_new_tokens, self.context_limit - len(ids))
        reserve = len(ids) + max_new
        if reserve > self.max_tokens:
            raise ValueError(
                f"the request needs {reserve} KV tokens (prompt {len(ids)} + max_new_tokens {max_new}) but the "
                f"engine's max_tokens is {self.max_tokens}; lower max_new_tokens or raise max_tokens."
            )
        eos = params.eos_token_id
        if eos is None:
            eos = self.target.generation_config.eos_token_id
        eos = set() if eos is None or params.ignore_eos else {eos} if isinstance(eos, int) else set(eos)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        sampler = RowSampler(build_processors(params), params.do_sample, generator)
        policy = repr(self.policy) if self.policy is not None else "none"
        stats = GenerationStats(block_size=max(self.gamma, 1), policy=policy)
        return _Request(rid, ids, params, sampler, eos, max_new, reserve, times, stats)

    def _admit(self) -> list[_Request]:
        admitted = []
        while self._queue and len(self._active) < self.max_batch_size and self._fits(self._queue[0]):
            req = self._queue.popleft()
            req.kv = SlotRow(self._kv, self._kv.add(req))
            req.dkv = SlotRow(self._dkv, self._dkv.add(req)) if self.speculate else None
            req.times["admitted"] = time.perf_counter()
            self._reserved += req.reserve
            self._active.append(req)
            admitted.append(req)
        return admitted

    def _row_tokens(self, req: _Request) -> int:
        """Tokens a slot of `req` may need: its reservation and one round's scratch (anchor + γ drafts)."""
        return req.reserve + self.gamma + 1

    def _fits(self, req: _Request) -> bool:
        """Whether admitting `req` keeps the reservations, and the slot buffers (every slot as long as the
        longest request's), within `max_tokens`. A request alone is always admitted (it fits by itself)."""
        if not self._active:
            return True
        if self._reserved + req.reserve > self.max_tokens:
            return False
        row = max(self._row_tokens(r) for r in [*self._active, req])
        if (len(self._kv) + 1) * row > self.max_tokens:
            return False
        for store in (self._kv, self._dkv):  # buffers sized for departed requests: give that memory back first
            if (
                store is not None
                and max(store.allocated_rows, len(store) + 1) * max(store.capacity, row) > self.max_tokens
            ):
                store.shrink(row)
        return True

    # ------------------------------------------------------------------ rounds
    def _prefill(self, reqs: list[_Request], events: list[StreamEvent]) -> None:
        start = time.perf_counter()
        out = ragged_target_forward(
            self.target, [r.kv for r in reqs], [r.prompt for r in reqs], [[len(r.prompt) - 1] for r in reqs],
            self.layer_ids, self.layout, self._linear_cost,
        )  # fmt: skip
        self.metrics.layout_counts[out.layout] += 1
        commit_rows(self._kv, [r.kv.slot for r in reqs], out.new_kv, [len(r.prompt) for r in reqs])
        firsts = []
        for i, req in enumerate(reqs):
            logits = req.sampler.process(req.prompt, out.logits[i])
            firsts.append(req.sampler.pick(logits[0]))
            if self.speculate:  # ingested by the draft when it next drafts (a round that does not, never pays)
                req.pending.append(out.features[i])
        for req, token in zip(reqs, firsts):
            req.times["first_token"] = time.perf_counter()
            self._emit(req, [token], events)
        self.metrics.prefill_forwards += 1
        self.metrics.prefill_seconds += time.perf_counter() - start

    def _decode_round(self, reqs: list[_Request], events: list[StreamEvent]) -> None:
        t0 = time.perf_counter()
        anchors = [r.tokens[-1] for r in reqs]
        # the round always emits one target token, so at most `remaining - 1` drafts can be useful
        budgets = [max(0, min(self.gamma, r.max_new - len(r.tokens) - 1)) for r in reqs]
        drafted = [[] for _ in reqs]
        lengths = [0] * len(reqs)
        block = host = None
        context = self.schedule_context
        context.planned_length = None
        t_head, catch_up = t0, 0.0
        copies = self._copies(reqs, budgets)  # a copy round (`None`: none, or the gate declines) does not draft
        if copies is not None:
            drafted, lengths = copies, [len(c) for c in copies]
        elif self.speculate and max(budgets) > 0:
            # a policy may fix the length before drafting; 0 means this round is a plain decoding step
            context.planned_length = self.policy.plan_length(len(reqs), self.gamma, context)
        if copies is None and self.speculate and max(budgets) > 0 and context.planned_length != 0:
            catch_up = self._ingest_pending(reqs)
            anchor_ids = torch.tensor(anchors, device=self.draft.device)
            graphed = None
            if self.graphs is not None and all(not r.sampler.do_sample and not r.sampler.processors for r in reqs):
                graphed = self.graphs.run([r.dkv for r in reqs], anchor_ids)  # one replay (None: capture failed)
            if graphed is not None:
                t_head = time.perf_counter()
                block, scores = graphed
                self.graph_rounds += 1
            else:
                # only the positions a length fixed before drafting can verify (all of them without one)
                hidden, base = draft_block(self.draft, self._dkv, anchor_ids, positions=context.planned_length)
                t_head = time.perf_counter()
                histories = [r.prompt + r.tokens if r.sampler.processors else None for r in reqs]
                sampler = RowsSampler([r.sampler for r in reqs], histories, self.draft.device)
                block = sample_block(
                    self.draft, hidden, base, anchor_ids, sampler, guessed_path=self.options.guessed_path
                )
                scores = score_block(block, self.temperatures)
            host = read_round(block, scores)
            drafted = host.tokens
            lengths = verified_lengths(self.policy, context, host, budgets, [r.eos for r in reqs])
        t1 = time.perf_counter()
        rows = [[a] + d[:n] for a, d, n in zip(anchors, drafted, lengths)]
        keep = [list(range(len(row))) for row in rows]
        layout = self.layout
        if layout == "auto":
            layout = choose_layout(self._kv.lengths[: len(reqs)], list(map(len, rows)), self._linear_cost)
        if layout == "padded":  # in place in the slots: no copy of any row's past
            out = slot_target_forward(self.target, self._kv, rows, keep, self.layer_ids)
        else:
            out = ragged_target_forward(
                self.target, [r.kv for r in reqs], rows, keep, self.layer_ids, "packed", self._linear_cost
            )
        self.metrics.layout_counts[out.layout] += 1
        outcomes = self._accept(reqs, block, drafted, lengths, out.logits, copied=copies is not None)
        committed = [n + 1 for n, _ in outcomes]  # the anchor and the accepted drafts (that is the rollback)
        if out.new_kv is None:
            for req, c in zip(reqs, committed):
                self._kv.lengths[req.kv.slot] += c
        else:
            commit_rows(self._kv, [r.kv.slot for r in reqs], out.new_kv, committed)
        emitted = []
        for i, req in enumerate(reqs):
            n, token = outcomes[i]
            if self.speculate:
                req.pending.append(out.features[i][: n + 1])
            emitted.append(drafted[i][:n] + [token])
            self.metrics.record_request_round(lengths[i], n, copied=copies is not None and bool(copies[i]))
        if self.speculate:  # bound the features kept for a draft that has not drafted for a long while
            self._ingest_pending([r for r in reqs if r.pending_tokens >= _PENDING_LIMIT])
        t2 = time.perf_counter()
        for i, req in enumerate(reqs):
            if self.speculate:  # a row without budget drafted nothing useful: recorded as an empty block
                has = host is not None and budgets[i] > 0
                stats = round_stats(host, i, lengths[i]) if has else empty_round_stats()
                if copies is not None and copies[i]:
                    stats.source, stats.drafted, stats.verified = "lookup", copies[i], lengths[i]
                    self.lookup_gate.record(lengths[i], outcomes[i][0])
                stats.accepted = outcomes[i][0]
                stats.draft_time, stats.sequential_time, stats.verify_time = t_head - t0, t1 - t_head, t2 - t1
                req.stats.rounds.append(stats)
            self._emit(req, emitted[i], events)
        m = self.metrics
        m.rounds += 1
        m.forward_tokens += sum(len(row) for row in rows)
        m.queue_length_sum += len(self._queue)
        m.draft_seconds += t1 - t0
        m.verify_seconds += t2 - t1
        computed = len(rows) * max(map(len, rows)) if out.layout == "padded" else sum(map(len, rows))
        m.computed_tokens += computed
        m.drafting_rounds += host is not None
        m.lookup_rounds += copies is not None
        if self.lookup_gate is not None:
            emitted_tokens = len(reqs) + sum(n for n, _ in outcomes)
            self.lookup_gate.observe(len(reqs), copies is not None, emitted_tokens, time.perf_counter() - t0)
        if self.speculate and copies is None:  # the policy weighs drafting against plain rounds; a copy is neither
            self.policy.observe_round(
                context,
                rows=len(reqs),
                forward_tokens=computed,
                rest_seconds=time.perf_counter() - t1,
                draft_seconds=t1 - t0 - catch_up if host is not None else None,
                survival=torch.tensor(host.survival) if host is not None and host.confidence_logits else None,
                verified=lengths,
                accepted=[n for n, _ in outcomes],
            )

    def _copies(self, reqs: list[_Request], budgets: list[int]) -> list[list[int]] | None:
        """Each row's prompt-lookup copy (`[]` where its last tokens do not recur), capped at its budget; `None`
        when lookup is off, no row has a copy, or the [`LookupGate`] declines copying at this batch size."""
        if self.lookup is None or max(budgets) <= 0 or not self.lookup_gate.allows(len(reqs)):
            return None
        if self._copy_length([[0] * b for b in budgets]) == 0:  # not even a copy for every row would pay: no search
            self.lookup_gate.probing = False
            return None
        copies = []
        for req, budget in zip(reqs, budgets):
            if req.lookup is None:
                req.lookup = LookupIndex(req.prompt, self.lookup)
            copies.append(req.lookup.continuation(req.tokens, budget) if budget > 0 else [])
        length = self._copy_length(copies) if any(copies) else 0
        if length == 0:
            self.lookup_gate.probing = False  # nothing was tried: a probe waits for a round that can copy
            return None
        return [c[:length] for c in copies]

    def _copy_length(self, copies: list[list[int]]) -> int:
        """How many copied tokens a copy round verifies per row: where the target's SPS profile is known, the
        one length `L` that maximises expected tokens per second of the round ([`uniform_length`]: a padded
        forward computes `rows · (1 + L)` tokens; the gain is the copies' expected accepted tokens, from the
        gate's per-position acceptance), `0` when no length pays; without a profile, the longest copy."""
        longest = max(map(len, copies))
        profile = getattr(self.policy, "sps", None)
        sps = profile.sps if profile is not None else self.schedule_context.sps
        if sps is None:
            return longest
        rows = len(copies)
        measured = {b: statistics.median(ts) for (r, b), ts in self.schedule_context.round_seconds.items() if r == rows}
        return uniform_length(self.lookup_gate.survival(copies), rows, sps, measured=measured)

    def _draft_graphs(self, requested: bool | None):
        """The CUDA-graph runner of the draft step (greedy rows without processors), or `None` for eager."""
        if requested is False or (requested is None and self.draft.device.type != "cuda"):
            return None
        reason = draft_graphs.graph_unavailable(self.draft, None)
        if reason is None:
            return draft_graphs.DraftStepGraphs(self.draft, None, do_sample=False)
        log = logger.warning if requested else logger.info
        log("DSpark engine: CUDA graphs of the draft step are off, running it eagerly: %s.", reason)
        return None

    def _ingest_pending(self, reqs: list[_Request]) -> float:
        """Bring the rows' draft contexts up to date with every token they have committed (one draft pass).

        Returns the seconds of it that catch up on rounds that did not draft (the share of tokens older than
        the last round): a drafting round's own cost, which the policy weighs, excludes them, or a policy that
        paused drafting would see its first drafting round as dear and never resume.
        """
        reqs = [r for r in reqs if r.pending]
        if not reqs:
            return 0.0
        start = time.perf_counter()
        features = [torch.cat(r.pending) if len(r.pending) > 1 else r.pending[0] for r in reqs]
        total = sum(f.shape[0] for f in features)
        latest = sum(r.pending[-1].shape[0] for r in reqs)
        ingest(self.draft, self._dkv, features, slots=[r.dkv.slot for r in reqs])
        for req in reqs:
            req.pending = []
        return (time.perf_counter() - start) * (1 - latest / total)

    def _release(self, req: _Request) -> None:
        """Take `req` out of the batch: its reservation now, its slots at the next round's compaction."""
        self._active.remove(req)
        self._reserved -= req.reserve
        self._kv.free(req.kv.slot)
        if req.dkv is not None:
            self._dkv.free(req.dkv.slot)
        req.pending = []

    def _compact(self) -> None:
        """Close the holes finished requests left in the slot stores (moves only the rows that fill them) and
        keep `_active` in slot order."""
        for store, attr in ((self._kv, "kv"), (self._dkv, "dkv")):
            if store is None:
                continue
            for req, slot in store.compact():
                getattr(req, attr).slot = slot
        self._active = list(self._kv.owners)
        limit = max((self._row_tokens(r) for r in self._active), default=0)
        for store in (self._kv, self._dkv):
            if store is not None:
                store.limit = limit  # the buffers' capacity never outgrows the longest active request

    def _accept(self, reqs, block, drafted, lengths, target_logits, copied=False) -> list[tuple[int, int]]:
        """Each row's (accepted drafts, next token): greedy rows without processors all at once (one host
        read), the others one by one. In a copy round (`copied`) the proposals are `drafted`, on the host."""
        greedy = [i for i, r in enumerate(reqs) if not r.sampler.do_sample and not r.sampler.processors]
        outcomes: list[tuple[int, int] | None] = [None] * len(reqs)
        if greedy:
            tokens = None
            if copied:
                width = max(1, *(lengths[i] for i in greedy))
                padded = [drafted[i][: lengths[i]] + [0] * (width - lengths[i]) for i in greedy]
                tokens = torch.tensor(padded, device=target_logits[0].device)
            elif block is not None:
                tokens = block.tokens if len(greedy) == len(reqs) else block.tokens[greedy]
            accepted = accept_greedy_rows(tokens, [lengths[i] for i in greedy], [target_logits[i] for i in greedy])
            for i, outcome in zip(greedy, accepted):
                outcomes[i] = outcome
        for i, req in enumerate(reqs):
            if outcomes[i] is not None:
                continue
            q = block.logits[i, : lengths[i]] if block is not None else None
            history = req.prompt + req.tokens if req.sampler.processors else []  # only processors read it
            if copied:  # a deterministic proposal: no `q`
                outcomes[i] = accept_copy_row(req.sampler, history, drafted[i][: lengths[i]], target_logits[i])
            else:
                outcomes[i] = accept_row(req.sampler, history, drafted[i][: lengths[i]], q, target_logits[i])
        return outcomes

    def _emit(self, req: _Request, tokens: list[int], events: list[StreamEvent]) -> None:
        new = []
        for t in tokens:
            new.append(t)
            req.tokens.append(t)
            if t in req.eos:
                req.finish_reason = "eos"
                break
            if len(req.tokens) >= req.max_new:
                req.finish_reason = "length" if req.max_new == req.params.max_new_tokens else "context"
                break
        self.metrics.tokens_generated += len(new)
        text = self._new_text(req, final=req.finish_reason is not None) if self.tokenizer is not None else None
        if req.finish_reason is None:
            events.append(StreamEvent(req.rid, new, text))
            return
        req.times["finished"] = time.perf_counter()
        self._release(req)  # frees the reservation now: this is what lets queued requests in
        self.metrics.requests_finished += 1
        output = RequestOutput(
            req.rid,
            req.prompt,
            req.tokens,
            text=req.text,
            finish_reason=req.finish_reason,
            stats=req.stats,
            times=req.times,
        )
        events.append(StreamEvent(req.rid, new, text, finished=True, output=output))

    def _new_text(self, req: _Request, final: bool) -> str:
        """The text of the tokens not yet streamed, decoding only a short window, not the whole output.

        The window starts at the tokens streamed by the previous call, so that merges across the boundary (a
        byte-level token completing a character, a tokenizer's space rules) are seen; text that ends in an
        incomplete character is held back. The last call decodes the whole output once and sends what the
        stream still lacks, so the streamed pieces always add up to `RequestOutput.text`.
        """
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        if final:
            req.text = decode(req.tokens)
            new, req.text_len = req.text[req.text_len :], len(req.text)
            return new
        before = decode(req.tokens[req.text_prefix : req.text_done])
        after = decode(req.tokens[req.text_prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""  # nothing complete yet: held back until a later round (or the final flush)
        new = after[len(before) :]
        req.text_prefix, req.text_done = req.text_done, len(req.tokens)
        req.text_len += len(new)
        return new


#: Features a row may hold back from its draft before they are ingested anyway (a draft not drafting for long).
_PENDING_LIMIT = 256


def _per_prompt(sampling_params, n: int) -> list:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; give one, or one per prompt.")
    return params


def _check_params(params: SamplingParams) -> None:
    """Refuse sampling parameters transformers would refuse, naming the allowed range."""
    checks = [
        (params.max_new_tokens >= 1, "max_new_tokens must be >= 1", params.max_new_tokens),
        (params.temperature > 0, "temperature must be > 0 (use do_sample=False for greedy)", params.temperature),
        (params.top_k is None or params.top_k >= 0, "top_k must be >= 0", params.top_k),
        (params.top_p is None or 0 < params.top_p <= 1, "top_p must be in (0, 1]", params.top_p),
        (params.repetition_penalty is None or params.repetition_penalty > 0, "repetition_penalty must be > 0",
         params.repetition_penalty),
    ]  # fmt: skip
    for ok, message, value in checks:
        if not ok:
            raise ValueError(f"{message}, got {value}.")
