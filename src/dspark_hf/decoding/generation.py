"""Speculative `generate()` with a DSpark draft: the only module that touches transformers' generate internals.

transformers' assisted decoding picks its candidate generator in the private
`GenerationMixin._get_candidate_generator`; there is no registry. `install_generate_hook` wraps that one
method: when the assistant is a [`DSparkDraftModel`] it returns a [`DSparkCandidateGenerator`], otherwise
it calls the original untouched, so every other mode (plain assistants, prompt lookup, DFlash, MTP)
behaves exactly as without this package. `tests/test_transformers_contract.py` fails loudly if a
transformers release changes the wrapped signature or the protocol below.

The protocol (transformers >= 5.8): a generator with `requires_model_outputs = True` receives the target's
previous forward output (with the hidden states we ask for through `model_kwargs_overrides`) and returns
`(ids, logits)`: the sequence plus `k` candidates and the `k` processed draft distributions (the `q` of
rejection sampling), or `(input_ids, None)` for an ordinary target step. Verification, acceptance and the
target's cache rollback stay in transformers; exactness never depends on the draft.

With a draft vocabulary subset `S` (`draft.set_draft_vocab`) the draft computes its logits for `S` only;
before the logits processors run they are expanded to the full vocabulary with `-inf` outside `S`, so the
returned `q` is exactly the (processed) distribution each token was drawn from, zero outside `S`.
"""

from __future__ import annotations

import copy
import time
from contextvars import ContextVar
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator

from .._transformers import (
    EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS,
    eos_token_ids,
    hidden_states_request,
    hook_candidate_generator,
    hook_generate,
    recording_layers,
    selected_hidden_states,
)
from ..model.compat import check_target_compatibility
from ..kernels import use_kernels
from ..model.modeling import DSparkDraftModel
from ..scheduling.policies import ScheduleContext
from .caches import KVStore
from .compiled import CompiledRound
from .draft_graphs import draft_step_graphs
from .drafting import (
    BlockScores,
    DraftedBlock,
    SequenceSampler,
    draft_block,
    empty_round_stats,
    ingest,
    read_round,
    sample_block,
    score_block,
    verified_lengths,
)
from .drafting import round_stats as make_round_stats
from .lookup import lookup_continuation
from .options import SpeculationOptions, call_options, config_key, resolve_options
from .stats import GenerationStats, RoundStats

__all__ = ["EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS", "DSparkCandidateGenerator", "install_generate_hook"]

#: The target-layer recorder of the speculative `generate()` call running in this context: made by the call's
#: wrapper (which removes its hooks when the call ends), read by the candidate generator transformers builds
#: inside that call. Scoped to the call, never parked on the draft.
_CALL_RECORDER: ContextVar = ContextVar("dspark_call_recorder", default=None)


#: Committed tokens whose features may wait for the draft's next drafting round before they are ingested anyway.
_PENDING_LIMIT = 256


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts γ tokens per round with a DSpark draft and lets a verification policy choose how many to verify.

    Args:
        draft ([`DSparkDraftModel`]): the draft, bound to `target`.
        target (`PreTrainedModel`): the model being generated from.
        generation_config (`GenerationConfig`): the call's generation config. Its `dspark_*` attributes (where
            `generate(dspark_policy=..., ...)` keywords are carried too) are resolved with the draft's defaults
            by [`resolve_options`], the one precedence every driver uses: the policy, prompt lookup, CUDA graphs
            of the draft step, the compiled round (on the exact CPU kernels) and the sequential head's guessed path.
        logits_processor (`LogitsProcessorList`, *optional*): the target's processors (temperature, top-k,
            top-p, repetition penalty, …); applied identically to the draft so sampling stays exact.
        recorder (`LayerRecorder`, *optional*): the hooks recording the target layers' outputs for this call (see
            `install_generate_hook`); without it the features are asked of transformers (`output_hidden_states`).

    Prompt lookup (`dspark_hf.decoding.lookup`), when on, proposes before the draft drafts: a round whose last
    tokens recur in the context verifies the copy instead of a draft; verification is the same, so output stays
    exactly the target's.
    """

    requires_model_outputs = True

    def __init__(
        self, draft: DSparkDraftModel, target, generation_config, logits_processor=None, recorder=None
    ) -> None:
        self.draft = draft
        self.target = target
        self.config = draft.config
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        self.eos_token_ids = eos_token_ids(generation_config)
        self.options: SpeculationOptions = resolve_options(draft, target, generation_config=generation_config)
        self.policy, self.lookup = self.options.policy, self.options.lookup
        self.schedule_context = ScheduleContext()
        if self.policy.needs_sps and getattr(self.policy, "sps", None) is None:
            from ..scheduling.sps import get_sps_profile

            self.schedule_context.sps = get_sps_profile(target).sps
        # the target layers' outputs: recorded by hooks of this call (generate() below) where the layers can be
        # hooked, else asked of transformers (whose capturing hooks then stay on the target for good, ~3%/forward)
        self.recorder = recorder
        self.model_kwargs_overrides = (
            {}
            if self.recorder is not None
            else {"output_hidden_states": hidden_states_request(self.config.target_layer_ids)}
        )
        if draft.draft_vocab_ids is not None and int(draft.draft_vocab_ids.min()) < 0:
            raise ValueError(
                f"The draft's config sets draft_vocab_size={draft.config.draft_vocab_size} but its draft_vocab_ids "
                "were never filled in (a draft built directly from such a config). Call "
                "`draft.set_draft_vocab(ids)`, or load the draft with `DSparkDraftModel.from_pretrained`."
            )
        self.store = KVStore(self.max_length)
        self.temperatures = torch.tensor(self.config.calibration_temperatures, dtype=torch.float32, device=draft.device)
        # the draft's own random source, seeded from torch's global one so `torch.manual_seed` reproduces a call
        self.generator = None
        if self.do_sample:
            self.generator = torch.Generator(device=draft.device)
            self.generator.manual_seed(int(torch.randint(0, 2**62, (1,))))
        self.stats = GenerationStats(block_size=self.config.block_size, policy=repr(self.policy))
        draft.last_generation_stats = self.stats
        self.graphs = draft_step_graphs(draft, self.options.cuda_graphs, logits_processor, self.do_sample, self.stats)
        # on the exact CPU kernels, the round in three compiled calls (dspark_hf.decoding.compiled)
        self.compiled = (
            CompiledRound.create(draft, self.max_length) if self.graphs is None and self.options.compiled else None
        )
        self.greedy = not self.do_sample and not logits_processor
        self._pending: RoundStats | None = None
        self._verify_start = 0.0
        self._features: list[torch.Tensor] = []  # committed target features the draft has not ingested yet
        self._features_pending = 0

    # ------------------------------------------------------------------ protocol
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        # The prefill must run first: it produces the hidden states the draft conditions on.
        if is_first_iteration:
            return input_ids, None
        with torch.no_grad():
            t0 = time.perf_counter()
            self._collect_context(input_ids, model_outputs)
            budget = self.max_length - input_ids.shape[1] - 1  # the round always adds one target token
            gamma = min(self.config.block_size, budget)
            copied = lookup_continuation(input_ids[0], self.lookup, gamma) if self.lookup and gamma > 0 else []
            if copied:  # the context already holds a continuation: verify the copy, the draft does not run
                if self._features_pending >= _PENDING_LIMIT:
                    self._ingest_pending()
                self._pending = empty_round_stats()
                self._pending.source, self._pending.drafted, self._pending.verified = "lookup", copied, len(copied)
                self._pending.draft_time = time.perf_counter() - t0
                self._verify_start = time.perf_counter()
                proposal = torch.tensor([copied], dtype=input_ids.dtype, device=input_ids.device)
                # no `q`: a copy is a deterministic proposal, which transformers verifies exactly (greedy: the
                # longest agreeing prefix; sampling: each position sampled from the target and compared)
                return torch.cat([input_ids, proposal], dim=-1), None
            # a policy may fix the length before drafting; 0 makes this round an ordinary target step
            planned = self.policy.plan_length(1, self.config.block_size, self.schedule_context) if gamma > 0 else 0
            self.schedule_context.planned_length = planned
            if gamma <= 0 or planned == 0:  # room for the target's own token only, or no draft pays off
                if self._features_pending >= _PENDING_LIMIT:
                    self._ingest_pending()
                self._pending = empty_round_stats()
                self._verify_start = time.perf_counter()
                return input_ids, None
            t0 += self._ingest_pending()  # catching up on rounds that did not draft is not this round's cost
            anchors = input_ids[:, -1].to(self.draft.device)
            block, scores, t1 = self._draft(input_ids, anchors, planned)
            tokens = block.tokens[0]
            host = read_round(block, scores)
            length = verified_lengths(self.policy, self.schedule_context, host, [gamma], [self.eos_token_ids])[0]
            round_stats = make_round_stats(host, 0, length)
            t2 = time.perf_counter()
        round_stats.draft_time, round_stats.sequential_time = t1 - t0, t2 - t1
        self._pending = round_stats
        self._verify_start = time.perf_counter()
        if length == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, tokens[None, :length].to(input_ids.device)], dim=-1)
        if block.logits is None:  # a greedy round: transformers compares tokens and never reads `q`
            return candidates, None
        return candidates, block.logits[:, :length].to(input_ids.device)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Record the round's outcome (transformers calls this after every verification)."""
        if self._pending is None:  # the prefill round
            return
        pending = self._pending
        pending.accepted = int(num_matches)
        pending.verify_time = time.perf_counter() - self._verify_start
        self.stats.rounds.append(pending)
        self._pending = None
        if pending.source == "lookup":  # the policy weighs the draft against plain rounds; a copy is neither
            return
        drafted = bool(pending.drafted)
        self.policy.observe_round(
            self.schedule_context,
            rows=1,
            forward_tokens=1 + pending.verified,
            rest_seconds=pending.verify_time,
            draft_seconds=pending.draft_time + pending.sequential_time if drafted else None,
            survival=torch.tensor([pending.survival]) if drafted and pending.survival else None,
            verified=[pending.verified],
            accepted=[pending.accepted],
        )

    # ------------------------------------------------------------------ steps of a round (R = 1 of drafting.py)
    def _collect_context(self, input_ids: torch.LongTensor, model_outputs: Any) -> None:
        """Keep the target features of tokens committed since the last round, for the draft's context.

        Every token except the newest (the anchor, which the target has not processed yet) is committed.
        The target's last forward covered `[previous anchor, verified drafts]`; its first `n_new` positions
        are exactly the newly committed tokens (the whole prompt after the prefill). They enter the draft's KV
        store when the draft next drafts ([`_ingest_pending`]): a round the policy does not draft in never
        runs the draft.
        """
        committed = input_ids.shape[1] - 1
        n_new = committed - len(self.store) - self._features_pending
        if n_new <= 0:
            return
        if self.recorder is not None:  # the hooked layers' outputs of that same (latest) target forward
            feats = self.recorder.features()[0, :n_new]
        else:
            hidden_states = getattr(model_outputs, "hidden_states", None)
            if hidden_states is None:
                raise RuntimeError("The target's forward returned no hidden_states; DSpark needs them for its context.")
            feats = selected_hidden_states(hidden_states, self.config.target_layer_ids)[0, :n_new]
        if feats.shape[0] != n_new:
            raise RuntimeError(
                f"Context bookkeeping error: {n_new} newly committed tokens but the target returned hidden "
                f"states for {feats.shape[0]}."
            )
        self._features.append(feats)
        self._features_pending += n_new

    def _ingest_pending(self) -> float:
        """Bring the draft's context up to date; returns the seconds spent on tokens older than the last
        round (what skipped rounds left to catch up), which the round's measured drafting cost excludes."""
        if not self._features:
            return 0.0
        start = time.perf_counter()
        latest = self._features[-1].shape[0]
        feats = torch.cat(self._features) if len(self._features) > 1 else self._features[0]
        if self.compiled is not None:
            self.compiled.ingest(self.store, feats)
        else:
            ingest(self.draft, [self.store], [feats])
        self._features, self._features_pending = [], 0
        return (time.perf_counter() - start) * (1 - latest / feats.shape[0])

    def _draft(
        self, input_ids: torch.LongTensor, anchors: torch.Tensor, planned: int | None = None
    ) -> tuple[DraftedBlock, BlockScores, float]:
        """Steps 2–4 of the round: the block, its scores, and when the backbone finished (`perf_counter`).

        One graph replay when the graph path is on (the backbone's time then covers the launch only); the
        compiled round's calls on the exact CPU kernels (a greedy round without logits processors entirely, else
        the block, then the sequential head eagerly); else [`draft_block`] and the sequential head eagerly. On
        the first `planned` positions only when the policy fixed the length before drafting (the positions
        after it could never be verified). A greedy compiled round returns no `q` (`block.logits` is `None`).
        """
        if self.graphs is not None:
            graphed = self.graphs.run([self.store], anchors, self.generator)
            if graphed is not None:
                return (*graphed, time.perf_counter())
        if self.compiled is not None:
            anchor = int(anchors[0])
            hidden, base_logits = self.compiled.block(self.store, anchor, planned)
            t1 = time.perf_counter()
            if self.greedy:
                tokens, conf_logits = self.compiled.greedy(hidden, base_logits, anchor)
                block = DraftedBlock(tokens[None], None, conf_logits[None] if conf_logits is not None else None)
                return block, score_block(block, self.temperatures), t1
        else:
            hidden, base_logits = draft_block(self.draft, [self.store], anchors, positions=planned)
            hidden, base_logits = hidden[0], base_logits[0]
            t1 = time.perf_counter()
        tokens, logits, conf_logits = self._sample_sequentially(input_ids, hidden, base_logits)
        block = DraftedBlock(tokens[None], logits[None], conf_logits[None] if conf_logits is not None else None)
        return block, score_block(block, self.temperatures), t1

    def _sample_sequentially(
        self, input_ids: torch.LongTensor, hidden: torch.Tensor, base_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[`sample_block`] for this one row: drafted tokens `[γ]`, processed logits `[γ, V]` (the `q` of
        verification) and confidence logits `[γ]` (or `None`)."""
        sampler = SequenceSampler(self.logits_processor, input_ids, self.do_sample, self.generator)
        anchors = input_ids[:, -1]
        block = sample_block(
            self.draft, hidden[None], base_logits[None], anchors, sampler, guessed_path=self.options.guessed_path
        )
        conf = block.confidence_logits[0] if block.confidence_logits is not None else None
        return block.tokens[0], block.logits[0], conf


# ---------------------------------------------------------------------- the single hook into transformers
def install_generate_hook() -> None:
    """Make `generate(assistant_model=<DSparkDraftModel>)` use DSpark (idempotent; done on `import dspark_hf`).

    transformers picks an assisted-decoding candidate generator in a private method with no registry; the hook
    (`dspark_hf._transformers.hook_candidate_generator`, signature-guarded) returns a [`DSparkCandidateGenerator`]
    for a DSpark draft and leaves every other assistant to transformers. `generate()` itself is wrapped thinly
    ([`_generate`]) for what must span the whole call.
    """
    hook_candidate_generator(_candidate_generator)
    hook_generate(_generate)


def _candidate_generator(target, generation_config, input_ids, logits_processor, assistant_model):
    """The candidate generator for `assistant_model` when it is a DSpark draft, else `None` (transformers' own)."""
    if not isinstance(assistant_model, DSparkDraftModel):
        return None
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"Speculative generate() with a DSpark draft runs one sequence at a time, got a batch of "
            f"{input_ids.shape[0]}. transformers' assisted decoding is batch-size-1 only; loop over the "
            "prompts, or serve them together with `dspark_hf.DSparkEngine` (the batched engine)."
        )
    if assistant_model.bound_target is not target:
        assistant_model.bind_target(target)
    recorder = _CALL_RECORDER.get()
    return DSparkCandidateGenerator(assistant_model, target, generation_config, logits_processor, recorder=recorder)


def _generate(original, target, *args, **kwargs):
    """`GenerationMixin.generate` with the DSpark options: a thin wrapper, kept for three things a
    `GenerationConfig` cannot carry.

    1. The `dspark_*` keywords (`dspark_policy=`, `dspark_lookup=`, ...: `dspark_hf.decoding.options`), which
       transformers would reject, are moved onto (a copy of) the call's generation config, where the candidate
       generator reads them with every other level through `resolve_options`.
    2. The kernel scope (`dspark_kernels`) must span the whole call: the prefill and, for a plain call, every step.
    3. The hooks that record the target layers' outputs for the draft must span the whole call and be removed
       when it ends (a candidate generator is never told that); they reach it through a context variable of
       this call, not through the draft.

    It also checks the draft against the target before transformers' vocabulary check, which would answer a
    mismatch with a confusing "different tokenizers" message. Nothing is stored on the draft.
    """
    draft = kwargs.get("assistant_model")
    call = call_options(kwargs)
    if not isinstance(draft, DSparkDraftModel):
        misplaced = sorted(config_key(name) for name in call if name != "kernels")
        if misplaced:
            raise ValueError(f"`{misplaced[0]}` only applies with `assistant_model=<DSparkDraftModel>`.")
        args, config = _carry_options(args, kwargs, call)
        if getattr(config, "dspark_kernels", None) is None:
            return original(target, *args, **kwargs)  # a plain call that names no kernels: transformers' own
        options = resolve_options(None, target, generation_config=config)
        with use_kernels(target, mode=options.kernels):
            return original(target, *args, **kwargs)
    check_target_compatibility(draft.config, target)
    args, config = _carry_options(args, kwargs, call)
    options = resolve_options(draft, target, generation_config=config)
    # On a CPU the target (and the draft) run on the call's kernel mode: packed or exact kernels make verifying
    # k tokens cost about what one token does (see dspark_hf.kernels).
    with (
        use_kernels(target, draft, mode=options.kernels),
        recording_layers(target, draft.config.target_layer_ids) as recorder,
    ):
        token = _CALL_RECORDER.set(recorder)
        try:
            return original(target, *args, **kwargs)
        finally:
            _CALL_RECORDER.reset(token)


def _carry_options(args: tuple, kwargs: dict, call: dict) -> tuple[tuple, Any]:
    """Put the call's `dspark_*` values on its generation config (a copy; the caller's is left alone) and return
    `(args, config)`. Without a config of its own the call gets a fresh one holding its generation keywords, as
    transformers builds it (which then fills the rest from the target's generation config)."""
    positional = len(args) > 1  # generate(inputs, generation_config, ...)
    config = args[1] if positional else kwargs.get("generation_config")
    if not call:
        return args, config
    if config is not None:
        config = copy.deepcopy(config)
    else:
        config = GenerationConfig()
        config.update(**{key: kwargs.pop(key) for key in list(kwargs) if hasattr(config, key)})
    for name, value in call.items():
        setattr(config, config_key(name), value)
    if positional:
        return (args[0], config, *args[2:]), config
    kwargs["generation_config"] = config
    return args, config
