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

import functools
import inspect
import time
from typing import Any

import torch
import transformers
from transformers import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator

from .._transformers import eos_token_ids, hidden_states_request, recording_layers, selected_hidden_states
from ..model.compat import check_target_compatibility
from ..model.kernels import default_kernels, explicit_kernels, use_kernels
from ..model.modeling import DSparkDraftModel
from ..scheduling.policies import ScheduleContext, resolve_policy
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
from .lookup import first_lookup_setting, lookup_continuation
from .stats import GenerationStats, RoundStats

EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS = (
    "self",
    "generation_config",
    "input_ids",
    "inputs_tensor",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
    "target_tokenizer",
    "assistant_tokenizer",
)


#: Committed tokens whose features may wait for the draft's next drafting round before they are ingested anyway.
_PENDING_LIMIT = 256


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts γ tokens per round with a DSpark draft and lets a verification policy choose how many to verify.

    Args:
        draft ([`DSparkDraftModel`]): the draft, bound to `target`.
        target (`PreTrainedModel`): the model being generated from.
        generation_config (`GenerationConfig`): the call's generation config. The verification policy (a
            policy object or string, see [`resolve_policy`]) is, by precedence: `generate(dspark_policy=...)`,
            `generation_config.dspark_policy`, `draft.policy`, the draft config's `default_policy` (the shipped
            drafts record the policy measured fastest for them), then `"hardware_aware_uniform"` for a draft
            with a calibrated confidence head and `"fixed"` otherwise.
        logits_processor (`LogitsProcessorList`, *optional*): the target's processors (temperature, top-k,
            top-p, repetition penalty, …); applied identically to the draft so sampling stays exact.

    Prompt lookup (`dspark_hf.decoding.lookup`) proposes before the draft drafts when it is on: by precedence
    `generate(dspark_lookup=...)`, `generation_config.dspark_lookup`, `draft.lookup`, the draft config's
    `default_lookup`, then off. A round whose last tokens recur in the context verifies the copy instead of a
    draft; verification is the same, so output stays exactly the target's.

    On the exact CPU kernels (the CLI's default for a float32 CPU target) the drafting round runs as three
    compiled calls (`dspark_hf.decoding.compiled`; drafts exactly what the eager round drafts; set
    `draft.compiled_round = False` for the eager round).

    The draft step runs as a captured CUDA graph when the `cuda_graphs` option is on (by precedence
    `generate(dspark_cuda_graphs=...)`, `generation_config.dspark_cuda_graphs`, `draft.cuda_graphs`; `None`, the
    default, is on for a CUDA draft), see `dspark_hf.decoding.draft_graphs`.
    """

    requires_model_outputs = True

    def __init__(self, draft: DSparkDraftModel, target, generation_config, logits_processor=None) -> None:
        self.draft = draft
        self.target = target
        self.config = draft.config
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        self.eos_token_ids = eos_token_ids(generation_config)
        spec = (
            draft._call_policy
            or getattr(generation_config, "dspark_policy", None)
            or draft.policy
            or self.config.default_policy
        )
        self.policy = resolve_policy(
            spec, has_confidence=draft.confidence_head is not None, calibrated=self.config.confidence_calibrated
        )
        # prompt lookup as a second proposer (dspark_hf.decoding.lookup), by the same precedence as the policy
        settings = (draft._call_lookup, getattr(generation_config, "dspark_lookup", None), draft.lookup)
        settings += (self.config.default_lookup,)
        self.lookup = first_lookup_setting(*settings)
        self.schedule_context = ScheduleContext()
        if self.policy.needs_sps and getattr(self.policy, "sps", None) is None:
            from ..scheduling.sps import get_sps_profile

            self.schedule_context.sps = get_sps_profile(target).sps
        # the target layers' outputs: recorded by hooks of this call (generate() below) where the layers can be
        # hooked, else asked of transformers (whose capturing hooks then stay on the target for good, ~3%/forward)
        self.recorder = getattr(draft, "_call_recorder", None)
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
        self.graphs = draft_step_graphs(draft, generation_config, logits_processor, self.do_sample, self.stats)
        # on the exact CPU kernels, the round in three compiled calls (dspark_hf.decoding.compiled)
        self.compiled = (
            CompiledRound.create(draft, self.max_length)
            if self.graphs is None and getattr(draft, "compiled_round", True)
            else None
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
        block = sample_block(self.draft, hidden[None], base_logits[None], anchors, sampler)
        conf = block.confidence_logits[0] if block.confidence_logits is not None else None
        return block.tokens[0], block.logits[0], conf


# ---------------------------------------------------------------------- the single hook into transformers
def _check_private_signature(method) -> None:
    params = tuple(inspect.signature(method).parameters)
    if params != EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS:
        raise RuntimeError(
            "dspark_hf cannot hook into this transformers release: GenerationMixin._get_candidate_generator has "
            f"parameters {params}, expected {EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS}. Please report this with "
            f"your transformers version ({transformers.__version__})."
        )


def install_generate_hook() -> None:
    """Make `generate(assistant_model=<DSparkDraftModel>)` use DSpark (idempotent; done on `import dspark_hf`).

    The wrapper handles DSpark drafts and delegates every other call to the original method unchanged.
    """
    original = GenerationMixin._get_candidate_generator
    if getattr(original, "_dspark_wrapped", False):
        return
    _check_private_signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model=None,
        target_tokenizer=None,
        assistant_tokenizer=None,
    ):
        if not isinstance(assistant_model, DSparkDraftModel):
            return original(
                self,
                generation_config,
                input_ids,
                inputs_tensor,
                logits_processor,
                model_kwargs,
                assistant_model,
                target_tokenizer,
                assistant_tokenizer,
            )
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"Speculative generate() with a DSpark draft runs one sequence at a time, got a batch of "
                f"{input_ids.shape[0]}. transformers' assisted decoding is batch-size-1 only; loop over the "
                "prompts, or serve them together with `dspark_hf.DSparkEngine` (the batched engine)."
            )
        if assistant_model.bound_target is not self:
            assistant_model.bind_target(self)
        return DSparkCandidateGenerator(assistant_model, self, generation_config, logits_processor)

    _get_candidate_generator._dspark_wrapped = True
    _get_candidate_generator._dspark_original = original
    GenerationMixin._get_candidate_generator = _get_candidate_generator

    # generate() (public API) validates the assistant's vocabulary before any candidate generator exists and
    # would answer a mismatch with a confusing "different tokenizers" message; check our draft first.
    original_generate = GenerationMixin.generate

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        draft = kwargs.get("assistant_model")
        # `dspark_kernels=` ("stock" / "packed" / "exact", see dspark_hf.model.kernels) applies to plain and speculative
        # calls alike, so both can run on the same kernels; without it, a mode set with set_kernels() does.
        kernels = kwargs.pop("dspark_kernels", None)
        if not isinstance(draft, DSparkDraftModel):
            for name in ("dspark_policy", "dspark_cuda_graphs", "dspark_lookup"):
                if name in kwargs:
                    raise ValueError(f"`{name}` only applies with `assistant_model=<DSparkDraftModel>`.")
            kernels = kernels or explicit_kernels()
            if kernels is None:
                return original_generate(self, *args, **kwargs)
            with use_kernels(self, mode=kernels):
                return original_generate(self, *args, **kwargs)
        check_target_compatibility(draft.config, self)
        # `dspark_policy=` as a generate() argument applies to this call only; transformers would reject an
        # unknown keyword, so it is handed to the candidate generator through the draft.
        draft._call_policy = kwargs.pop("dspark_policy", None)
        draft._call_cuda_graphs = kwargs.pop("dspark_cuda_graphs", None)  # likewise (draft_graphs.py)
        draft._call_lookup = kwargs.pop("dspark_lookup", None)  # likewise (lookup.py)
        try:
            # On a CPU the target (and the draft) run on the call's kernel mode: packed or exact kernels make
            # verifying k tokens cost about what one token does (see dspark_hf.model.kernels).
            with (
                use_kernels(self, draft, mode=kernels or default_kernels()),
                recording_layers(self, draft.config.target_layer_ids) as draft._call_recorder,
            ):
                return original_generate(self, *args, **kwargs)
        finally:
            draft._call_policy = None
            draft._call_cuda_graphs = None
            draft._call_lookup = None
            draft._call_recorder = None

    generate._dspark_original = original_generate
    GenerationMixin.generate = generate
