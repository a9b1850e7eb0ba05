"""`DSparkEngine`: many concurrent requests, continuous batching, one batched verification forward per round.

A round ([`DSparkEngine.step`]) does, for all active requests at once:

1. **admit** queued requests while fewer than `max_batch_size` are active and their KV reservations
   (prompt + `max_new_tokens`) fit in `max_tokens`; an admitted request is **prefilled** in chunks: each round
   gives the prefilling requests, oldest first, at most `max_prefill_tokens` prompt tokens in all (on the
   exact kernels riding in the decoding round's forward, else one batched target forward of their own after
   it), so a long prompt is ingested over several rounds while the others keep decoding; a request emits its
   first token when its last chunk is in, and decodes from the next round on;
2. **propose**: the [`Speculator`] (`dspark_hf.decoding.speculator`, the same round `generate()` runs with one
   row) proposes for every decoding request at once: the requests' prompt-lookup copies where they pay, else
   one batched draft (backbone, then the sequential head with each request's own processors and generator),
   with each request's verification length `ℓ_r` from the policy over the batch's survival matrix `[R, γ]`;
3. **verify**: ONE target forward over the ragged rows `[anchor_r, x_1..x_ℓ_r]` (on the exact kernels
   unpadded, each row over its own KV slot; else padded or packed, see `dspark_hf.decoding.target_forward`),
   then per-request acceptance (greedy, or exact rejection sampling);
4. **commit**: each request's length in its KV slot advances by its committed tokens (rejected drafts stay
   beyond it, masked, until overwritten: that is the rollback), their target features wait for the draft's
   next drafting round (a round that does not draft never runs the draft), and accepted tokens are emitted
   with incrementally decoded text. Finished requests free their reservations, which lets queued ones in.

Every active request owns one slot of two preallocated stores (`dspark_hf.decoding.caches.SlotKV`, target
and draft): the unpadded forward of the exact kernels reads each row's past from its slot and writes its new
keys/values there in place; the padded one reads the batch's past as views and writes in place at each row's
own positions, with masks and positions built on the device from the rows' lengths.

Exactness does not depend on batching or on chunking: every request sees exactly its own context (masks and
position ids), and a chunk attends to its request's cached keys and, causally, to itself, so greedy output
equals plain `generate()` on that prompt alone and sampling follows the target's distribution
(`tests/decoding/test_engine.py`, `tests/decoding/test_engine_sampling.py`, `tests/decoding/test_engine_lookup.py`,
`tests/decoding/test_chunked_prefill.py`).

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
import time
from collections import deque
from collections.abc import Iterator

import torch

from ..kernels import EXACT_MODES, build_exact_kernels, use_kernels
from ..kernels.lean_model import varlen_stack
from ..scheduling.policies import ScheduleContext
from .backends import BackendSetup
from .caches import SlotKV, SlotRow
from .drafting import PerRowSampler, sample_block
from .lookup import LookupGate
from .metrics import EngineMetrics
from .options import resolve_options
from .prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from .requests import (
    Request,
    RequestOutput,
    SamplingParams,
    StreamEvent,
    check_params,
    new_text,
    per_prompt,
    tokenize_prompt,
)
from .speculator import DraftRow, Proposal, Speculator
from .stats import GenerationStats
from .target_forward import (
    LAYOUTS,
    RequestSampler,
    accept_rows,
    build_processors,
    choose_layout,
    commit_rows,
    context_limit,
    linear_cost_in_keys,
    ragged_target_forward,
    slot_target_forward,
    varlen_target_forward,
)

logger = logging.getLogger(__name__)


#: The engine's prefill budget per step when none is given (`max_prefill_tokens`).
DEFAULT_MAX_PREFILL_TOKENS = 512


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
        max_prefill_tokens (`int`, *optional*, defaults to 512): most prompt tokens prefilled per round, over
            all prefilling requests (oldest first; in a padded forward, padding included; a longer prompt is
            prefilled in chunks over several rounds). It bounds how long one round's prefill holds up the
            decoding requests (their inter-token latency under load) at the price of more rounds until a long
            prompt's first token; any value gives the same output.
        layout (`str`, *optional*, defaults to `"auto"`): layout of the ragged target forwards: `"padded"`,
            `"packed"`, or `"auto"` to pick the cheaper per forward from a cost model (see
            `dspark_hf.decoding.target_forward` and `docs/engine.md` for which is faster where).
        sps ([`SPSProfile`], *optional*): the target's SPS profile for hardware-aware policies; measured and
            cached on first use if needed and not given.
        kernels (`str`, *optional*): the CPU kernel mode of the target's (and draft's) forwards, with or
            without speculation (see `dspark_hf.kernels`): `"stock"`, `"packed"`, `"exact"` or `"exact-bf16"`
            (`"exact"` with every linear on the exact bf16 GEMM; the same guarantee, within that mode). In
            `"exact"` every row of every decoding round is computed exactly as a one-row forward computes it,
            so a request's greedy output is token-identical *by construction* to plain `generate()` on the
            same kernels (`dspark_kernels="exact"`), at every prompt length: the exact kernels compute a
            prefill's rows as decoding does, so the engine's chunks and `generate()`'s one-shot prefill give
            the same keys, values and logits; the forwards run unpadded, each row over its own KV slot
            (`dspark_hf.decoding.target_forward.varlen_target_forward`; the padded layout where hooks rule
            the compiled stack out). Defaults to the draft's own default, then the library's
            (`dspark_hf.kernels.default_kernels`: a bfloat16 target's is `"exact-bf16"`). The models are
            switched while the engine has work and switched back when it is idle.
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
        prefix_cache_bytes (`int`, *optional*): bytes of the [`PrefixCache`] (`dspark_hf.decoding.prefix_cache`):
            the keys and values (and the draft's target features) of prompt beginnings the engine has prefilled,
            in blocks of 8 tokens, so that a request whose prompt begins like an earlier one (a system message,
            earlier turns of a conversation) copies that beginning instead of prefilling it. Exact by
            construction on the exact kernels, the only ones it runs on; `0` turns it off. Defaults to 256 MiB
            in the exact modes, off otherwise. [`reset_prefix_cache`] empties it.

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
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}.")
        self.max_prefill_tokens = max_prefill_tokens
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
        if kernels in EXACT_MODES and layout == "packed":
            raise ValueError(
                "layout='packed' puts every row in one sequence, whose attention spans every row's past; the "
                "exact mode runs the padded layout: use layout='padded' or 'auto', or name other kernels "
                "(kernels='stock'): the exact ones are the library's default for a float32 CPU target."
            )
        self.kernels = kernels
        self.cpu_packing = kernels == "packed"
        if kernels in EXACT_MODES:
            self.layout = "padded"  # one row per request: each request's tokens are its own sequence
            build_exact_kernels()  # now (a minute on first use, then cached), not inside the first request's round
        self._kernel_scope: contextlib.ExitStack | None = None  # the kernel mode, held while there is work
        if prefix_cache_bytes is None:
            prefix_cache_bytes = DEFAULT_PREFIX_CACHE_BYTES if kernels in EXACT_MODES else 0
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}.")
        if prefix_cache_bytes and kernels not in EXACT_MODES:
            raise ValueError(
                f"the prefix cache runs on the exact kernels only (there a prompt's keys and values do not depend "
                f"on the rows and chunks it was prefilled with), not on kernels={kernels!r}: pass "
                "prefix_cache_bytes=0, or kernels='exact' / 'exact-bf16'."
            )
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        if self.speculate:
            if draft.bound_target is not target:
                draft.bind_target(target)
            if self.policy.needs_sps and getattr(self.policy, "sps", None) is None and sps is None:
                from ..scheduling.sps import get_sps_profile

                with use_kernels(target, mode=self.kernels):  # measured on the kernels it will run
                    sps = get_sps_profile(target)
        # the round's draft side (policy, prompt lookup and its gate, the drafting backend): one Speculator, R rows
        setup = BackendSetup(rows=max_batch_size, per_row_sampling=True)
        self.speculator = Speculator(draft, target, self.options, setup, sps=sps) if self.speculate else None
        self.layer_ids = list(draft.config.target_layer_ids) if self.speculate else None
        self.metrics = EngineMetrics(block_size=max(self.gamma, 1))
        self._queue: deque[Request] = deque()
        self._active: list[Request] = []
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
            ids = tokenize_prompt(self.tokenizer, prompt)
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

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (requests in flight keep what they restored). Returns whether there is one."""
        if self.prefix_cache is None:
            return False
        self.prefix_cache.clear()
        self.metrics.prefix_cache_bytes = 0
        return True

    def has_unfinished(self) -> bool:
        """`bool`: whether any request is queued, active or has an undelivered result."""
        return bool(self._queue or self._active or self._failed or self._buffered)

    @property
    def queue_length(self) -> int:
        """`int`: requests waiting for admission."""
        return len(self._queue)

    @torch.no_grad()
    def step(self) -> list[StreamEvent]:
        """Run one round (admissions, one drafting + verification round of the decoding requests, then the
        prefilling requests' next chunks, at most `max_prefill_tokens` tokens) and return its events."""
        start = time.perf_counter()
        events, self._buffered = self._buffered, []
        for out in self._failed:
            self.metrics.requests_finished += 1
            self.metrics.requests_failed += 1
            events.append(StreamEvent(out.request_id, [], finished=True, output=out))
        self._failed = []
        self._compact()
        decoding = [r for r in self._active if self._decodes(r)]  # slots 0..R-1, in order (see `_compact`)
        self._admit()
        prefilling = [r for r in self._active if not self._decodes(r)]
        if (decoding or prefilling) and self._kernel_scope is None and self.kernels != "stock":
            # switching a model's kernels walks its modules (milliseconds): done once per busy period, not per round
            self._kernel_scope = contextlib.ExitStack()
            self._kernel_scope.enter_context(use_kernels(self.target, self.draft, mode=self.kernels))
        stack = self._varlen_stack()  # once per step: every forward of the step runs unpadded, or none does
        if decoding:
            self._decode_round(decoding, events, stack, prefilling if stack is not None else ())
            prefilling = [] if stack is not None else prefilling
        if prefilling:
            self._prefill(prefilling, events, stack)
        self._compact()  # finished requests' slots (and, when idle, the buffers) are given back now
        if not self._active and not self._queue:
            self.release_kernels()
        m = self.metrics
        m.busy_seconds += time.perf_counter() - start
        kv_bytes = self._kv.nbytes + (self._dkv.nbytes if self._dkv is not None else 0)
        m.record_gauges(len(self._active), len(self._queue), sum(len(r.kv) for r in self._active), kv_bytes)
        m.prefix_cache_bytes = self.prefix_cache.nbytes if self.prefix_cache is not None else 0
        return events

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        """Submit `prompts` and yield their [`StreamEvent`]s as tokens are accepted, until all are finished.

        Events of other requests (added with [`add_request`]) are kept for the next [`step`] call.
        """
        prompts = list(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt(sampling_params, len(prompts)))]
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
    def _make_request(self, rid: int, ids: list[int], params: SamplingParams, times: dict) -> Request:
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
        check_params(params)
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
        sampler = RequestSampler(build_processors(params), params.do_sample, generator)
        policy = repr(self.policy) if self.policy is not None else "none"
        stats = GenerationStats(block_size=max(self.gamma, 1), policy=policy)
        return Request(rid, ids, params, sampler, eos, max_new, reserve, times, stats)

    def _admit(self) -> list[Request]:
        admitted = []
        while self._queue and len(self._active) < self.max_batch_size and self._fits(self._queue[0]):
            req = self._queue.popleft()
            req.kv = SlotRow(self._kv, self._kv.add(req))
            if self.speculate:
                req.dkv = SlotRow(self._dkv, self._dkv.add(req))
                req.draft = DraftRow(req.dkv, req.prompt, req.tokens, stats=req.stats)
            req.times["admitted"] = time.perf_counter()
            self._reserved += req.reserve
            self._active.append(req)
            admitted.append(req)
        return admitted

    def _row_tokens(self, req: Request) -> int:
        """Tokens a slot of `req` may need: its reservation and one round's scratch (anchor + γ drafts)."""
        return req.reserve + self.gamma + 1

    def _fits(self, req: Request) -> bool:
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
    @staticmethod
    def _decodes(req: Request) -> bool:
        """Whether `req`'s prompt is all in its KV slot (it takes part in decoding rounds)."""
        return req.prefilled == len(req.prompt)

    def _prefill(self, reqs: list[Request], events: list[StreamEvent], stack) -> None:
        """One chunk of prefill: the prefilling requests' next prompt tokens, oldest request first, at most
        `max_prefill_tokens` in all (counting the padding of a padded forward), in ONE target forward over their
        cached chunks so far (each chunk attends to its request's committed keys and causally to itself, as the
        one-shot prefill of the prompt would). A request whose last chunk this is gets its first token."""
        start = time.perf_counter()
        rows, chunks = self._prefill_chunks(reqs, stack)
        keep = [[len(c) - 1] for c in chunks]
        if stack is not None:  # written into the slots in place
            slots = [r.kv.slot for r in rows]
            out = varlen_target_forward(self.target, stack, self._kv, slots, chunks, keep, self.layer_ids)
        else:
            out = ragged_target_forward(
                self.target, [r.kv for r in rows], chunks, keep, self.layer_ids, self.layout, self._linear_cost
            )
        self.metrics.layout_counts[out.layout] += 1
        self._prefilled(rows, chunks, out, events)
        self.metrics.prefill_forwards += 1
        self.metrics.prefill_seconds += time.perf_counter() - start

    def _prefill_chunks(self, reqs: list[Request], stack) -> tuple[list[Request], list[list[int]]]:
        """The requests of this round's prefill and their chunks: oldest request first, at most
        `max_prefill_tokens` tokens in all (a padded forward counts its padding: rows x width). A request about to
        get its first chunk first takes its prompt's cached beginning from the prefix cache ([`_restore`]), so
        its chunk starts after it."""
        budget, rows, chunks, width, used = self.max_prefill_tokens, [], [], 0, 0
        for req in sorted(reqs, key=lambda r: r.rid):  # admission order
            if req.prefix is None and self.prefix_cache is not None:
                self._restore(req)
            if self.layout == "packed" or stack is not None:  # no padding: the budget is the tokens themselves
                n = min(len(req.prompt) - req.prefilled, budget - used)
            else:  # a padded forward computes every row as long as its longest: rows x width within the budget
                n = min(len(req.prompt) - req.prefilled, budget // (len(rows) + 1))
                if (len(rows) + 1) * width > budget:
                    break
            if n <= 0:
                break
            rows.append(req)
            chunks.append(req.prompt[req.prefilled : req.prefilled + n])
            width, used = max(width, n), used + n
        return rows, chunks

    def _restore(self, req: Request) -> None:
        """Before `req`'s first chunk: copy its prompt's longest cached beginning into its slot."""
        req.prefix, features = self.prefix_cache.restore(req.prompt, self._kv, req.kv.slot)
        req.prefilled = req.prefix.cached
        if features is not None and self.speculate:  # the draft reads these tokens' features like any others
            req.draft.hold(features)
        self.metrics.prefix_cache_queried_tokens += len(req.prompt)
        self.metrics.prefix_cache_hit_tokens += req.prefix.cached

    def _prefilled(self, rows: list[Request], chunks: list[list[int]], out, events: list[StreamEvent]) -> None:
        """After a forward over prefill chunks (`out`: their logits and features, keys/values in `out.new_kv` or
        already in the slots): commit the chunks, hand their features to the draft, and give each request whose
        last chunk this was its first token."""
        if out.new_kv is None:
            for req, chunk in zip(rows, chunks):
                self._kv.lengths[req.kv.slot] += len(chunk)
        else:
            commit_rows(self._kv, [r.kv.slot for r in rows], out.new_kv, [len(c) for c in chunks])
        firsts = []
        for i, (req, chunk) in enumerate(zip(rows, chunks)):
            req.prefilled += len(chunk)
            if self.speculate:  # in order, chunk by chunk; ingested by the draft when it next drafts
                req.draft.hold(out.features[i])
            if req.prefix is not None:  # the blocks this chunk completed, for later prompts that begin alike
                feats = out.features[i] if self.speculate else None
                self.prefix_cache.extend(req.prefix, req.prompt, req.prefilled, self._kv, req.kv.slot, feats)
            if self._decodes(req):  # its last chunk: the prompt's last logits give the first token
                logits = req.sampler.process(req.prompt, out.logits[i])
                firsts.append((req, req.sampler.pick(logits[0])))
        for req, token in firsts:
            req.times["first_token"] = time.perf_counter()
            self._emit(req, [token], events)
        m = self.metrics
        m.prefill_chunks += len(chunks)
        m.prefill_tokens += sum(map(len, chunks))

    def _decode_round(self, reqs: list[Request], events: list[StreamEvent], stack, prefilling=()) -> None:
        """One round: the speculator proposes (copies, a drafted block, or nothing), ONE target forward verifies
        every row, each row accepts and commits, and the speculator learns the outcome. With the unpadded forward
        (`stack`, [`_varlen_stack`]'s), the `prefilling` requests' next chunks ride in the same forward (one pass
        over the weights)."""
        t0 = time.perf_counter()
        # the round always emits one target token, so at most `remaining - 1` drafts can be useful
        budgets = [max(0, min(self.gamma, r.max_new - len(r.tokens) - 1)) for r in reqs]
        proposal = self._propose(reqs, budgets)
        t1 = time.perf_counter()
        rows = [[r.tokens[-1]] + d[:n] for r, d, n in zip(reqs, proposal.tokens, proposal.lengths)]
        riding, riding_seconds = 0, 0.0  # prefill tokens in this round's forward, and their share of its time
        if stack is not None:  # one unpadded forward: the decoding rows, and the prefill chunks riding along
            prows, chunks = self._prefill_chunks(prefilling, stack) if prefilling else ([], [])
            keep = [list(range(len(row))) for row in rows] + [[len(c) - 1] for c in chunks]
            slots = [r.kv.slot for r in [*reqs, *prows]]
            both = varlen_target_forward(self.target, stack, self._kv, slots, rows + chunks, keep, self.layer_ids)
            self.metrics.layout_counts[both.layout] += 1
            out, pout = both.split(len(reqs))
            if chunks:
                self._prefilled(prows, chunks, pout, events)
                riding = sum(map(len, chunks))
                riding_seconds = (time.perf_counter() - t1) * riding / (riding + sum(map(len, rows)))
                self.metrics.prefill_forwards += 1  # (a forward shared with decoding rows: its share of the time)
                self.metrics.prefill_seconds += riding_seconds
        else:
            out = self._target_forward(reqs, rows)
        copied = proposal.source == "lookup"
        outcomes = self._accept(reqs, proposal.block, proposal.tokens, proposal.lengths, out.logits, copied=copied)
        accepted = [n for n, _ in outcomes]
        committed = [n + 1 for n in accepted]  # the anchor and the accepted drafts (that is the rollback)
        if out.new_kv is None:
            for req, c in zip(reqs, committed):
                self._kv.lengths[req.kv.slot] += c
        else:
            commit_rows(self._kv, [r.kv.slot for r in reqs], out.new_kv, committed)
        computed = len(rows) * max(map(len, rows)) if out.layout == "padded" else sum(map(len, rows))
        if self.speculate:  # the committed tokens' features wait for the draft's next drafting round
            for i, req in enumerate(reqs):
                req.draft.hold(out.features[i][: accepted[i] + 1])
            # the forward's time against all the tokens it computed (prefill chunks riding along included)
            seconds = time.perf_counter() - t1
            self.speculator.observe([r.draft for r in reqs], proposal, accepted, computed + riding, seconds)
        t2 = time.perf_counter()
        for i, req in enumerate(reqs):
            self.metrics.record_request_round(
                proposal.lengths[i], accepted[i], copied=copied and bool(proposal.tokens[i])
            )
            self._emit(req, proposal.tokens[i][: accepted[i]] + [outcomes[i][1]], events)
        m = self.metrics
        m.rounds += 1
        m.forward_tokens += sum(len(row) for row in rows)
        m.queue_length_sum += len(self._queue)
        m.draft_seconds += t1 - t0
        m.verify_seconds += t2 - t1 - riding_seconds
        m.computed_tokens += computed
        m.drafting_rounds += proposal.source == "draft"
        m.lookup_rounds += copied

    def _propose(self, reqs: list[Request], budgets: list[int]) -> Proposal:
        """The speculator's proposal for the rows (without speculation: nothing, a plain round)."""
        if not self.speculate:
            return Proposal("plain", [[] for _ in reqs], [0] * len(reqs))
        greedy = all(not r.sampler.do_sample and not r.sampler.processors for r in reqs)
        anchors, eos = [r.tokens[-1] for r in reqs], [r.eos for r in reqs]
        head = functools.partial(self._head, reqs)
        return self.speculator.propose([r.draft for r in reqs], anchors, budgets, eos, head=head, greedy=greedy)

    def _head(self, reqs: list[Request], hidden: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor):
        """The sequential head for the rows, each with its own processors, mode and generator."""
        histories = [r.prompt + r.tokens if r.sampler.processors else None for r in reqs]
        sampler = PerRowSampler([r.sampler for r in reqs], histories, self.draft.device)
        return sample_block(self.draft, hidden, base, anchors, sampler, guessed_path=self.options.guessed_path)

    def _target_forward(self, reqs: list[Request], rows: list[list[int]]):
        """ONE target forward over the ragged rows `[anchor_r, x_1..x_ℓ_r]`, padded or packed (where the unpadded
        forward of the exact kernels cannot run)."""
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
        return out

    def _varlen_stack(self):
        """The target's compiled layer stack when its forwards can run packed ([`varlen_target_forward`]): in the
        exact modes, while the kernels are held, with no hooks; else `None` (the padded or packed layouts)."""
        if self.kernels not in EXACT_MODES or self._kernel_scope is None:
            return None
        return varlen_stack(self.target, self.layer_ids)

    # ------------------------------------------------------------------ views of the speculator's state
    @property
    def schedule_context(self) -> ScheduleContext | None:
        """The policy's [`ScheduleContext`] (`None` without speculation)."""
        return self.speculator.context if self.speculator is not None else None

    @property
    def lookup_gate(self) -> LookupGate | None:
        """The [`LookupGate`] of copy rounds (`None` with prompt lookup off); settable, e.g. to tune it."""
        return self.speculator.gate if self.speculator is not None else None

    @lookup_gate.setter
    def lookup_gate(self, gate: LookupGate) -> None:
        self.speculator.gate = gate

    @property
    def graphs(self):
        """The CUDA-graph runner of the draft step when that backend runs (`None`: the engine drafts without)."""
        backends = self.speculator.backends if self.speculator is not None else []
        return next((b.graphs for b in backends if b.name == "cuda_graphs"), None)

    @property
    def graph_rounds(self) -> int:
        """Rounds whose draft step ran on the graph path."""
        backends = self.speculator.backends if self.speculator is not None else []
        return sum(b.rounds for b in backends if b.name == "cuda_graphs")

    def _copy_length(self, copies: list[list[int]]) -> int:
        """The copy length a round of these copies verifies (the speculator's rule)."""
        return self.speculator._copy_length(copies)

    def _release(self, req: Request) -> None:
        """Take `req` out of the batch: its reservation now, its slots at the next round's compaction."""
        self._active.remove(req)
        self._reserved -= req.reserve
        self._kv.free(req.kv.slot)
        if req.dkv is not None:
            self._dkv.free(req.dkv.slot)
            req.draft.drop_pending()

    def _compact(self) -> None:
        """Close the holes finished requests left in the slot stores (moves only the rows that fill them), put the
        decoding requests first (slots `0..R-1`: the rows of the round's target and draft forwards; each
        prefilling request found among them swaps places with a decoding one behind them) and keep `_active` in
        slot order."""
        stores = [(store, attr) for store, attr in ((self._kv, "kv"), (self._dkv, "dkv")) if store is not None]
        for store, attr in stores:
            for req, slot in store.compact():
                getattr(req, attr).slot = slot
        owners = self._kv.owners
        decodes = [self._decodes(r) for r in owners]
        first = sum(decodes)
        early = [i for i in range(first) if not decodes[i]]  # prefilling rows in the decoding rows' slots
        if early:
            late = [i for i in range(first, len(owners)) if decodes[i]]
            order = list(range(len(owners)))
            for a, b in zip(early, late):
                order[a], order[b] = b, a
            for store, attr in stores:
                for req, slot in store.arrange(order):
                    getattr(req, attr).slot = slot
        self._active = list(self._kv.owners)
        limit = max((self._row_tokens(r) for r in self._active), default=0)
        for store in (self._kv, self._dkv):
            if store is not None:
                store.limit = limit  # the buffers' capacity never outgrows the longest active request

    def _accept(self, reqs, block, drafted, lengths, target_logits, copied=False) -> list[tuple[int, int]]:
        """Each row's (accepted drafts, next token): [`accept_rows`] with the requests' samplers and histories."""
        histories = [r.prompt + r.tokens if r.sampler.processors else [] for r in reqs]  # what processors read
        return accept_rows([r.sampler for r in reqs], histories, block, drafted, lengths, target_logits, copied)

    def _emit(self, req: Request, tokens: list[int], events: list[StreamEvent]) -> None:
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
        text = (
            new_text(self.tokenizer, req, final=req.finish_reason is not None) if self.tokenizer is not None else None
        )
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
