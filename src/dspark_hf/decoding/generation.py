"""Speculative `generate()` with a DSpark draft: the only module that touches transformers' generate internals.

transformers' assisted decoding picks its candidate generator in the private
`GenerationMixin._get_candidate_generator`; there is no registry. `install_generate_hook` wraps that one
method: when the assistant is a [`DSparkDraftModel`] it returns a [`DSparkCandidateGenerator`], otherwise
it calls the original untouched, so every other mode (plain assistants, prompt lookup, DFlash, MTP)
behaves exactly as without this package. `tests/kernels/test_transformers_contract.py` fails loudly if a
transformers release changes the wrapped signature or the protocol below.

The protocol (transformers >= 5.8): a generator with `requires_model_outputs = True` receives the target's
previous forward output (with the hidden states we ask for through `model_kwargs_overrides`) and returns
`(ids, logits)`: the sequence plus `k` candidates and the `k` processed draft distributions (the `q` of
rejection sampling), or `(input_ids, None)` for an ordinary target step. Verification, acceptance and the
target's cache rollback stay in transformers; exactness never depends on the draft. The round itself (lookup,
policy, drafting backend, stats, feedback) is the [`Speculator`]'s (`dspark_hf.decoding.speculator`) with one
row: `get_candidates` is its `propose`, `update_candidate_strategy` its `observe`.

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
from ..kernels import use_kernels
from ..model.compat import check_target_compatibility
from ..model.modeling import DSparkDraftModel
from ..model.runs import remember_generation_stats
from .backends import BackendSetup
from .caches import KVStore
from .drafting import DraftedBlock, SharedSampler, sample_block
from .options import SpeculationOptions, call_options, config_key, resolve_options
from .speculator import DraftRow, Proposal, Speculator
from .stats import GenerationStats

__all__ = ["EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS", "DSparkCandidateGenerator", "install_generate_hook"]

#: The target-layer recorder of the speculative `generate()` call running in this context: made by the call's
#: wrapper (which removes its hooks when the call ends), read by the candidate generator transformers builds
#: inside that call. Scoped to the call, never parked on the draft.
_CALL_RECORDER: ContextVar = ContextVar("dspark_call_recorder", default=None)


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
    exactly the target's. On an accelerator the search comes after drafting, so that the round's one host read
    carries the target's newest token with the draft ([`Speculator.propose`]).
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
        # the draft's own random source, seeded from torch's global one so `torch.manual_seed` reproduces a call
        self.generator = None
        if self.do_sample:
            self.generator = torch.Generator(device=draft.device)
            self.generator.manual_seed(int(torch.randint(0, 2**62, (1,))))
        self.stats = GenerationStats(block_size=self.config.block_size, policy=repr(self.policy))
        # the round (policy, lookup, backend, the draft's context): the Speculator, with one row
        setup = BackendSetup(rows=1, max_length=self.max_length, processors=logits_processor, do_sample=self.do_sample)
        self.speculator = Speculator(draft, target, self.options, setup, stats=self.stats)
        remember_generation_stats(draft, self.stats)  # `dspark_hf.last_generation_stats(draft)` reads them, live
        self.row = DraftRow(KVStore(self.max_length), stats=self.stats, unread=self._unread_tokens)
        self.greedy = not self.do_sample and not logits_processor
        self._proposal: Proposal | None = None
        self._input_ids: torch.LongTensor | None = None
        self._verify_start = 0.0

    @property
    def schedule_context(self):
        """The policy's [`ScheduleContext`] (the speculator's)."""
        return self.speculator.context

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
            self._collect_context(input_ids, model_outputs)
            self._input_ids = input_ids
            budget = max(0, min(self.config.block_size, self.max_length - input_ids.shape[1] - 1))  # + 1 target token
            anchors = input_ids[:, -1].to(self.draft.device)
            proposal = self.speculator.propose(
                [self.row], anchors, [budget], [self.eos_token_ids], head=self._head, greedy=self.greedy,
                generator=self.generator,
            )  # fmt: skip
        self._proposal = proposal
        self._verify_start = time.perf_counter()
        length = proposal.lengths[0]
        if length == 0:  # room for the target's own token only, no draft pays off, or the policy verifies none
            return input_ids, None
        if proposal.block is None:  # a copy: verified without `q`, as a deterministic proposal (greedy: the
            # longest agreeing prefix; sampling: each position sampled from the target and compared). It is a
            # slice of the sequence itself, already on the device: no copy to it.
            start = self.row.lookup.start
            return torch.cat([input_ids, input_ids[:, start : start + length]], dim=-1), None
        block = proposal.block
        candidates = torch.cat([input_ids, block.tokens[:, :length].to(input_ids.device)], dim=-1)
        if block.logits is None:  # a greedy compiled round: transformers compares tokens and never reads `q`
            return candidates, None
        return candidates, block.logits[:, :length].to(input_ids.device)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Record the round's outcome (transformers calls this after every verification)."""
        if self._proposal is None:  # the prefill round
            return
        proposal, self._proposal = self._proposal, None
        rest = time.perf_counter() - self._verify_start
        forward_tokens = 1 + proposal.lengths[0]
        self.speculator.observe([self.row], proposal, [int(num_matches)], forward_tokens, rest)

    # ------------------------------------------------------------------ steps of a round (R = 1 of drafting.py)
    def _collect_context(self, input_ids: torch.LongTensor, model_outputs: Any) -> None:
        """Keep the target features of tokens committed since the last round, for the draft's context.

        Every token except the newest (the anchor, which the target has not processed yet) is committed.
        The target's last forward covered `[previous anchor, verified drafts]`; its first `n_new` positions
        are exactly the newly committed tokens (the whole prompt after the prefill). They enter the draft's KV
        store when the draft next drafts ([`Speculator.ingest`]): a round the policy does not draft in never
        runs the draft.
        """
        committed = input_ids.shape[1] - 1
        n_new = committed - len(self.row.store) - self.row.pending_tokens
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
        self.row.hold(feats)

    def _unread_tokens(self) -> torch.Tensor:
        """The tokens committed since prompt lookup last searched, on the device (the whole sequence at the first
        search); the [`Speculator`] reads them when lookup searches."""
        known = len(self.row.prompt) + len(self.row.generated)
        return self._input_ids[0, known:]

    def _head(self, hidden: torch.Tensor, base_logits: torch.Tensor, anchors: torch.Tensor) -> DraftedBlock:
        """The sequential head of this call's row (`[1, P, d]`, `[1, P, K]` in): [`_sample_sequentially`]."""
        tokens, logits, conf = self._sample_sequentially(self._input_ids, hidden[0], base_logits[0])
        return DraftedBlock(tokens[None], logits[None], conf[None] if conf is not None else None)

    def _sample_sequentially(
        self, input_ids: torch.LongTensor, hidden: torch.Tensor, base_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[`sample_block`] for this one row: drafted tokens `[γ]`, processed logits `[γ, V]` (the `q` of
        verification) and confidence logits `[γ]` (or `None`)."""
        sampler = SharedSampler(self.logits_processor, input_ids, self.do_sample, self.generator)
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
