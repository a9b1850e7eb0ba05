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
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from packaging import version
from transformers import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator

from ..model.compat import check_target_compatibility
from ..model.configuration import hidden_state_indices
from ..model.cpu_packing import packed_linears
from ..model.modeling import DSparkCache, DSparkDraftModel
from ..scheduling.policies import ScheduleContext, resolve_policy, survival_probabilities
from .stats import GenerationStats, RoundStats

# Selecting hidden states by index (unselected ones come back as None) saves memory; older releases only
# accept a bool.
_HIDDEN_STATES_BY_INDEX = version.parse(transformers.__version__) >= version.parse("5.23.0")

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


@dataclass
class _GuessedPath:
    """Sequential-head outputs precomputed along a guessed path of previous tokens (greedy drafting)."""

    prev_tokens: list[int]
    bias: torch.Tensor  # [γ, K] over the draft vocabulary (K = V without a subset)
    embeds: torch.Tensor  # [γ, r]
    states: list[torch.Tensor | None]  # head state after each position


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts γ tokens per round with a DSpark draft and lets a verification policy choose how many to verify.

    Args:
        draft ([`DSparkDraftModel`]): the draft, bound to `target`.
        target (`PreTrainedModel`): the model being generated from.
        generation_config (`GenerationConfig`): the call's generation config. The verification policy (a
            policy object or string, see [`resolve_policy`]) is, by precedence: `generate(dspark_policy=...)`,
            `generation_config.dspark_policy`, `draft.policy`, then `"hardware_aware"` for a draft with a
            calibrated confidence head and `"fixed"` otherwise.
        logits_processor (`LogitsProcessorList`, *optional*): the target's processors (temperature, top-k,
            top-p, repetition penalty, …); applied identically to the draft so sampling stays exact.
    """

    requires_model_outputs = True

    def __init__(self, draft: DSparkDraftModel, target, generation_config, logits_processor=None) -> None:
        self.draft = draft
        self.target = target
        self.config = draft.config
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)
        if eos is None and generation_config.eos_token_id is not None:
            eos = torch.tensor(generation_config.eos_token_id).reshape(-1)
        self.eos_token_ids = set(eos.reshape(-1).tolist()) if eos is not None else set()
        spec = draft._call_policy or getattr(generation_config, "dspark_policy", None) or draft.policy
        self.policy = resolve_policy(
            spec, has_confidence=draft.confidence_head is not None, calibrated=self.config.confidence_calibrated
        )
        self.schedule_context = ScheduleContext()
        if self.policy.needs_sps and getattr(self.policy, "sps", None) is None:
            from ..scheduling.sps import get_sps_profile

            self.schedule_context.sps = get_sps_profile(target).sps
        layers = hidden_state_indices(self.config.target_layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": layers if _HIDDEN_STATES_BY_INDEX else True}
        if draft.draft_vocab_ids is not None and int(draft.draft_vocab_ids.min()) < 0:
            raise ValueError(
                f"The draft's config sets draft_vocab_size={draft.config.draft_vocab_size} but its draft_vocab_ids "
                "were never filled in (a draft built directly from such a config). Call "
                "`draft.set_draft_vocab(ids)`, or load the draft with `DSparkDraftModel.from_pretrained`."
            )
        self.cache = DSparkCache(len(draft.layers))
        self.temperatures = torch.tensor(self.config.calibration_temperatures, dtype=torch.float32)
        self.stats = GenerationStats(block_size=self.config.block_size, policy=repr(self.policy))
        draft.last_generation_stats = self.stats
        self._pending: RoundStats | None = None
        self._verify_start = 0.0

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
            self._ingest_context(input_ids, model_outputs)
            budget = self.max_length - input_ids.shape[1] - 1  # the round always adds one target token
            gamma = min(self.config.block_size, budget)
            # a policy may fix the length before drafting; 0 makes this round an ordinary target step
            planned = self.policy.plan_length(1, self.config.block_size, self.schedule_context) if gamma > 0 else 0
            self.schedule_context.planned_length = planned
            if gamma <= 0 or planned == 0:  # room for the target's own token only, or no draft pays off
                self._pending = RoundStats(
                    drafted=[], confidence_logits=[], confidence=[], calibrated_confidence=[], survival=[], verified=0
                )
                self._verify_start = time.perf_counter()
                return input_ids, None
            hidden, base_logits = self._draft_block(input_ids)
            t1 = time.perf_counter()
            tokens, logits, conf_logits = self._sample_sequentially(input_ids, hidden, base_logits)
            length, round_stats = self._schedule(tokens, conf_logits, gamma)
            t2 = time.perf_counter()
        round_stats.draft_time, round_stats.sequential_time = t1 - t0, t2 - t1
        self._pending = round_stats
        self._verify_start = time.perf_counter()
        if length == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, tokens[None, :length].to(input_ids.device)], dim=-1)
        return candidates, logits[None, :length].to(input_ids.device)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Record the round's outcome (transformers calls this after every verification)."""
        if self._pending is None:  # the prefill round
            return
        pending = self._pending
        pending.accepted = int(num_matches)
        pending.verify_time = time.perf_counter() - self._verify_start
        self.stats.rounds.append(pending)
        self._pending = None
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

    # ------------------------------------------------------------------ steps of a round
    def _ingest_context(self, input_ids: torch.LongTensor, model_outputs: Any) -> None:
        """Append the target features of tokens committed since the last round to the draft's KV cache.

        Every token except the newest (the anchor, which the target has not processed yet) is committed.
        The target's last forward covered `[previous anchor, verified drafts]`; its first `n_new` positions
        are exactly the newly committed tokens (the whole prompt after the prefill).
        """
        committed = input_ids.shape[1] - 1
        n_new = committed - len(self.cache)
        if n_new <= 0:
            return
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None:
            raise RuntimeError("The target's forward returned no hidden_states; DSpark needs them for its context.")
        feats = [hidden_states[i][:, :n_new] for i in hidden_state_indices(self.config.target_layer_ids)]
        if feats[0].shape[1] != n_new:
            raise RuntimeError(
                f"Context bookkeeping error: {n_new} newly committed tokens but the target returned hidden "
                f"states for {feats[0].shape[1]}."
            )
        device = self.draft.device
        context = self.draft.project_context([f.to(device) for f in feats])
        positions = torch.arange(len(self.cache), committed, device=device)[None]
        self.draft.extend_context(self.cache, context, positions)

    def _draft_block(self, input_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One backbone forward over `[anchor, mask × (γ-1)]` → final states `[γ, d]`, base logits `[γ, K]`.

        `K` is the draft vocabulary's size (`V` without a subset; see `DSparkDraftModel.draft_logits`).
        """
        gamma = self.config.block_size
        device = self.draft.device
        block = torch.full((1, gamma), self.config.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = input_ids[0, -1]
        anchor_pos = input_ids.shape[1] - 1
        positions = torch.arange(anchor_pos, anchor_pos + gamma, device=device)[None]
        hidden = self.draft.run_backbone(self.draft.embed_tokens(block), positions, self.cache)
        return hidden[0], self.draft.draft_logits(hidden)[0]

    def _sample_sequentially(
        self, input_ids: torch.LongTensor, hidden: torch.Tensor, base_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Left-to-right sampling: `q_k = process(U_k + B_k(x_{k-1}))`, `x_k ~ q_k` (argmax when greedy).

        Returns the drafted tokens `[γ]`, the processed logits `[γ, V]` (the distributions the tokens were
        drawn from, as verification requires) and the confidence logits `[γ]` (or `None`).

        With a draft vocabulary subset, `U_k + B_k` is computed over the subset (`base_logits` is `[γ, K]`)
        and expanded to `[1, V]` with `-inf` outside it *before* the processors, so processors see token ids
        as usual and the token is drawn from exactly the processed row that is returned. If the processors
        leave no token of the subset (e.g. `suppress_tokens` covering it), that position falls back to the
        full vocabulary.

        The sequential head's only expensive part is its `r × V` output projection. In greedy mode the
        biases of a *guessed* path (each previous token = the argmax of the base logits) are projected in
        one pass over `W2` up front; while the drafted tokens follow the guess they are used as is, and from
        the first divergence on each position is computed exactly as before. The result is the same either
        way; only the memory traffic changes.
        """
        draft = self.draft
        head, conf_head = draft.markov_head, draft.confidence_head
        gamma = base_logits.shape[0]
        anchor = int(input_ids[0, -1])
        vocab = draft.draft_vocab_ids
        guess = self._guessed_path(anchor, hidden, base_logits) if head is not None and not self.do_sample else None
        prev = anchor
        state = head.init_state(1, hidden) if head is not None else None
        seq = input_ids
        tokens, logits_out, conf_out = [], [], []
        for k in range(gamma):
            h_k = hidden[k : k + 1]
            logits = base_logits[k : k + 1]
            prev_embed, state_before = None, state
            if head is not None:
                if guess is not None and prev == guess.prev_tokens[k]:
                    bias, prev_embed, state = guess.bias[k : k + 1], guess.embeds[k : k + 1], guess.states[k]
                else:
                    guess = None  # diverged from the guessed path: exact per-position computation from here
                    prev_embed = head.embed(torch.tensor([prev], device=draft.device))
                    bias, state = head.step(h_k, prev_embed, state, vocab)
                logits = logits + bias.to(logits.dtype)
            if conf_head is not None:  # computed under every policy: statistics and calibration read it
                conf_out.append(conf_head(h_k, prev_embed).float())
            logits = draft.expand_draft_logits(logits)  # [1, V]: -inf outside the draft vocabulary
            if self.logits_processor:
                logits = self.logits_processor(seq, logits.to(seq.device)).to(draft.device)
            if vocab is not None and not torch.isfinite(logits).any():  # the processors excluded all of S
                logits = draft.full_vocab_logits(h_k, prev_embed, state_before)
                if self.logits_processor:
                    logits = self.logits_processor(seq, logits.to(seq.device)).to(draft.device)
            if self.do_sample:
                token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)[:, 0]
            else:
                token = logits.argmax(dim=-1)
            tokens.append(token)
            logits_out.append(logits)
            seq = torch.cat([seq, token[None].to(seq.device)], dim=-1)
            prev = int(token)
        conf = torch.cat(conf_out) if conf_out else None
        return torch.cat(tokens), torch.cat(logits_out), conf

    def _guessed_path(self, anchor: int, hidden: torch.Tensor, base_logits: torch.Tensor) -> _GuessedPath:
        """The sequential head along previous tokens `[anchor, argmax U_1, …, argmax U_{γ-1}]`."""
        head, vocab = self.draft.markov_head, self.draft.draft_vocab_ids
        guessed = base_logits[:-1].argmax(dim=-1)  # columns of the draft vocabulary
        if vocab is not None:
            guessed = vocab[guessed]
        prev_tokens = torch.cat([torch.tensor([anchor]), guessed.cpu()])
        features, embeds, states = head.block_features(hidden[None], prev_tokens[None].to(hidden.device))
        return _GuessedPath(prev_tokens.tolist(), head.project(features[0], vocab), embeds[0], states)

    def _schedule(self, tokens: torch.Tensor, conf_logits: torch.Tensor | None, gamma: int) -> tuple[int, RoundStats]:
        """Ask the policy how many of the first `gamma` drafted tokens to verify."""
        if conf_logits is not None:
            raw = torch.sigmoid(conf_logits)
            calibrated = torch.sigmoid(conf_logits / self.temperatures.to(conf_logits.device)[: conf_logits.numel()])
            survival = survival_probabilities(calibrated)
        else:
            raw = calibrated = survival = torch.ones(tokens.numel())
        length = int(self.policy.choose_lengths(survival[None, :gamma], self.schedule_context)[0])
        # Nothing after an end-of-sequence token can be emitted: verifying it would waste target compute
        # (and transformers < 5.18 would even accept tokens past it).
        drafted = tokens.tolist()
        eos_at = next((i for i, t in enumerate(drafted[:length]) if t in self.eos_token_ids), None)
        if eos_at is not None:
            length = eos_at + 1
        if conf_logits is not None:
            self.schedule_context.previous_survival = survival[None, :gamma]
        stats = RoundStats(
            drafted=drafted,
            confidence_logits=conf_logits.tolist() if conf_logits is not None else [],
            confidence=raw.tolist() if conf_logits is not None else [],
            calibrated_confidence=calibrated.tolist() if conf_logits is not None else [],
            survival=survival.tolist() if conf_logits is not None else [],
            verified=length,
        )
        return length, stats


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
        if not isinstance(draft, DSparkDraftModel):
            if "dspark_policy" in kwargs:
                raise ValueError("`dspark_policy` only applies with `assistant_model=<DSparkDraftModel>`.")
            return original_generate(self, *args, **kwargs)
        check_target_compatibility(draft.config, self)
        # `dspark_policy=` as a generate() argument applies to this call only; transformers would reject an
        # unknown keyword, so it is handed to the candidate generator through the draft.
        draft._call_policy = kwargs.pop("dspark_policy", None)
        try:
            # On a CPU, the target's and the draft's linears run on packed weights for this call, so that
            # verifying k tokens costs about what one token does (see dspark_hf.model.cpu_packing).
            with packed_linears(self, draft):
                return original_generate(self, *args, **kwargs)
        finally:
            draft._call_policy = None

    generate._dspark_original = original_generate
    GenerationMixin.generate = generate
