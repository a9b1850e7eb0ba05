"""`DSparkDraftModel`: target features → context K/V → parallel backbone → sequential and confidence heads.

Data flow of one drafting round (batch `B`, block size `γ`, `m` selected target layers):

1. `project_context`: the raw outputs of the selected target layers for newly committed tokens,
   `[B, T, m·d]`, are fused by `fc` and `hidden_norm` into context features `H_ctx`.
2. `extend_context`: every draft layer projects `H_ctx` with its own `k_proj`/`v_proj` (k-norm, RoPE at
   the tokens' absolute positions) and appends the result to the row's `KVStore`
   (`dspark_hf.decoding.caches`). Only committed tokens ever enter the cache, so nothing needs rolling back
   after verification.
3. `run_backbone`: the block `[anchor, mask, …, mask]` (embedded with the target's own embedding) runs
   through the draft layers, attending to the cached context and bidirectionally within the block.
   After the final norm, the target's LM head gives the base logits `U_1..U_γ`.
4. The sequential head adds `B_k(x_{k-1})` to `U_k` while tokens are sampled left to right, and the
   confidence head scores each position (see `dspark_hf.decoding.generation`).

At inference the draft may propose from a vocabulary subset `S` only (`set_draft_vocab`, FR-Spec style):
`draft_logits` then computes `U` for the `K` ids of `S`, the sequential head's bias likewise, and
`expand_draft_logits` puts them back into a full-vocabulary row with `-inf` outside `S`, so the
distribution handed to verification is exactly the one the token was drawn from. `forward` (training) uses
the full vocabulary unless asked for the subset (`restrict_vocab=True`, `dspark train --draft_vocab_size K`).

The target's embedding and LM head are *bound*, not owned: they are neither trained nor saved with the
draft (a Qwen3-4B target would add ~1.5 GB of copies to every checkpoint). Call `bind_target` (done
automatically by `generate()`), or load with `DSparkDraftModel.from_pretrained(path, target=target)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration import DSparkConfig
from .formats import read_deepspec_checkpoint
from .generation_defaults import check_moved_attribute, defaults_from_config, load_defaults, save_defaults
from .heads import SEQUENTIAL_HEAD_CLASSES, ConfidenceHead, RNNHead
from .hub import checkpoint_format, push_draft
from .layers import GemmaRMSNorm, RMSNorm, build_layers, final_norm
from .loading import load_exact_weights, own_aligned_storage, refuse_pickle
from .speculators_format import read_speculators_checkpoint
from .vocab import SubsetRows, validate_vocab_ids


@dataclass
class DSparkOutput(ModelOutput):
    """Output of [`DSparkDraftModel.forward`] (teacher-forced blocks).

    Args:
        logits (`torch.FloatTensor` of shape `(B, S, V)`): base logits plus the sequential head's bias.
        base_logits (`torch.FloatTensor` of shape `(B, S, V)`): the backbone's logits `U` alone.
        confidence_logits (`torch.FloatTensor` of shape `(B, S)`, *optional*): raw (uncalibrated) logits
            of the confidence head.
        hidden_states (`torch.FloatTensor` of shape `(B, S, d)`): final-normed backbone states `h`.
    """

    logits: torch.Tensor | None = None
    base_logits: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DSparkDecoderLayer", "Gemma4DecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, GemmaRMSNorm)) and module.weight is not None:
            nn.init.ones_(module.weight)


class DSparkDraftModel(DSparkPreTrainedModel):
    """The DSpark draft: parallel backbone, sequential head and confidence head.

    Example:

    ```python
    >>> import dspark_hf
    >>> from dspark_hf import DSparkDraftModel
    >>> draft = DSparkDraftModel.from_target(target, num_hidden_layers=2)   # fresh, random draft
    >>> out = target.generate(**inputs, assistant_model=draft)               # same output, fewer passes
    >>> dspark_hf.last_generation_stats(draft).tau
    ```
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * d, d, bias=False)
        self.hidden_norm = final_norm(config)
        self.layers = build_layers(config)
        self.norm = final_norm(config)
        head_cls = SEQUENTIAL_HEAD_CLASSES.get(config.sequential_head)
        self.markov_head = head_cls(config) if head_cls is not None else None
        self.confidence_head = ConfidenceHead(config) if config.confidence_head else None
        # Bound target modules live in a plain tuple (embedding, LM head, target) so that nn.Module does not
        # register them: they are neither parameters of the draft nor saved with it.
        self._bound: tuple[nn.Module, nn.Module, nn.Module] | None = None
        # The draft vocabulary subset S (sorted ids, int64 [K]) or None for the full vocabulary. A buffer, so it
        # is saved in model.safetensors; a None buffer is not part of the state dict, so drafts without a
        # subset (and every checkpoint written before subsets existed) have exactly the keys they always had.
        # The -1 placeholder is overwritten by the checkpoint; `from_pretrained` checks that it was, and
        # `generate()` refuses a draft that still holds it (one built directly from a config with a size).
        k = config.draft_vocab_size
        self.register_buffer("draft_vocab_ids", None if k is None else torch.full((k,), -1, dtype=torch.long))
        self._head_rows, self._head_bias_rows = SubsetRows(), SubsetRows()  # W_head[S] (and bias[S]), gathered once
        # the draft's own runtime defaults (dspark_policy, dspark_lookup, ...: dspark_hf.decoding.options), saved
        # and loaded with the weights as generation_config.json, as transformers keeps an assistant's
        self.generation_config = defaults_from_config(config)
        self.post_init()

    def __setattr__(self, name: str, value) -> None:
        check_moved_attribute(name, value)  # draft.policy & co.: the runtime options live in its generation config
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ binding to the target
    @classmethod
    def from_target(cls, target: PreTrainedModel, **config_overrides) -> DSparkDraftModel:
        """Create a fresh (randomly initialised) draft shaped for `target`, bound to it.

        Args:
            target (`PreTrainedModel`): the causal LM to accelerate.
            **config_overrides: fields of [`DSparkConfig`], e.g. `num_hidden_layers=2, block_size=5`.
        """
        if config_overrides.get("draft_vocab_size") is not None:
            raise ValueError(
                f"draft_vocab_size={config_overrides['draft_vocab_size']!r} cannot be set through from_target: a "
                "subset needs its ids, not just their count. Create the draft, then call `draft.set_draft_vocab(ids)` "
                "(e.g. ids from `dspark_hf.model.vocab.frequent_token_ids`)."
            )
        config = DSparkConfig.from_target(target, **config_overrides)
        draft = cls(config).to(device=target.device, dtype=target.dtype)
        draft.bind_target(target)
        return draft

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target: PreTrainedModel | None = None, **kwargs):
        """Load a draft (safetensors only) and optionally bind it to `target`.

        Checkpoints in DeepSpec's format (`"architectures": ["Qwen3DSparkModel"]` or `["Gemma4DSparkModel"]`)
        and in the speculators format (`"speculators_model_type": "dspark"`) are converted on the fly.
        Pickle checkpoints (`pytorch_model.bin`) are refused. For a Hub repo id, a missing repo or revision
        raises `huggingface_hub`'s `RepositoryNotFoundError` / `RevisionNotFoundError` (see `dspark_hf.model.hub`).
        """
        path = os.fspath(pretrained_model_name_or_path)
        refuse_pickle(path)
        fmt = checkpoint_format(path, **kwargs)
        if fmt == "deepspec":
            draft = load_deepspec_checkpoint(path, **kwargs)
        elif fmt == "speculators":
            draft = load_speculators_checkpoint(path, **kwargs)
        else:
            kwargs.setdefault("use_safetensors", True)
            want_info = kwargs.pop("output_loading_info", False)
            draft, info = super().from_pretrained(path, *args, output_loading_info=True, **kwargs)
            own_aligned_storage(draft)
            # transformers leaves a missing buffer uninitialised (with a warning); for the draft vocabulary
            # that would be arbitrary ids, so a config that promises a subset must come with its ids.
            if "draft_vocab_ids" in info.get("missing_keys", ()):
                raise ValueError(
                    f"{path}: config.json sets draft_vocab_size={draft.config.draft_vocab_size} but the weights "
                    "hold no `draft_vocab_ids`. Re-save the draft after `draft.set_draft_vocab(ids)`, or remove "
                    "`draft_vocab_size` from config.json to use the full vocabulary."
                )
            draft._check_loaded_draft_vocab(path)
            draft.generation_config = load_defaults(path, draft.generation_config, **kwargs)
            if want_info:
                draft = (draft, info)
        if target is not None:
            (draft[0] if isinstance(draft, tuple) else draft).bind_target(target)
        return draft

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, plus the draft's own defaults as `generation_config.json` (which
        transformers writes for generative models only)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        save_defaults(self.generation_config, os.fspath(save_directory))
        return out

    def push_to_hub(self, repo_id: str, *, format: str = "dspark", **kwargs):  # noqa: A002
        """Push the draft to the Hub: config, safetensors weights and a generated model card, in one commit.

        Args:
            repo_id (`str`): destination repo, created if missing.
            format (`str`, *optional*, defaults to `"dspark"`): `"dspark"`, or `"deepspec"` for vLLM / SGLang.
            **kwargs: see [`dspark_hf.model.hub.push_draft`] (`revision`, `private`, `token`, `target`, `evaluation`,
                `training_config`, `license`, `tags`, ...).

        Returns:
            `huggingface_hub.CommitInfo`
        """
        return push_draft(self, repo_id, format=format, **kwargs)

    def bind_target(self, target: PreTrainedModel) -> DSparkDraftModel:
        """Use `target`'s input embedding and LM head (frozen, not copied). Checks compatibility first."""
        from .compat import check_target_compatibility

        check_target_compatibility(self.config, target)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if head is None:
            raise ValueError(
                f"{type(target).__name__} has no output embeddings (LM head); a DSpark draft needs a causal LM "
                "target such as one loaded with AutoModelForCausalLM."
            )
        self._bound = (embed, head, target)
        recorded = self.config.target_weights_fingerprint
        if recorded:
            from .fingerprint import warn_if_target_differs

            warn_if_target_differs(recorded, embed, head, target)
        return self

    @property
    def bound_target(self) -> PreTrainedModel | None:
        """The target this draft is bound to, or `None`."""
        return self._bound[2] if self._bound is not None else None

    @property
    def is_bound(self) -> bool:
        """`bool`: whether a target's embedding and LM head are bound."""
        return self._bound is not None

    def _require_bound(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        if self._bound is None:
            raise RuntimeError(
                "This DSpark draft is not bound to a target. Call `draft.bind_target(target)` or load it with "
                "`DSparkDraftModel.from_pretrained(path, target=target)`; `target.generate(assistant_model=draft)` "
                "binds automatically."
            )
        return self._bound

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's (frozen) input embedding of `input_ids`, in the draft's dtype."""
        return self._require_bound()[0](input_ids).to(self.dtype)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's (frozen) LM head applied to draft hidden states; logits in at least fp32.

        With `config.final_logit_softcapping` (Gemma) the logits are soft-capped as the target caps its own.
        """
        head = self._require_bound()[1]
        logits = head(hidden.to(head.weight.dtype))
        return self._softcap(logits.to(torch.promote_types(logits.dtype, torch.float32)))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ------------------------------------------------------------------ draft vocabulary subset (inference)
    def set_draft_vocab(self, token_ids) -> DSparkDraftModel:
        """Let the draft propose only `token_ids` (a subset `S` of the vocabulary), or all tokens again with `None`.

        The draft then computes its logits only for `S` (base logits and the sequential head's bias), which
        saves most of its LM-head cost on a large vocabulary. Generation stays exactly the target's: greedy
        verification compares tokens, and in sampling the draft's `q` is zero outside `S`, which rejection
        sampling handles exactly. A token outside `S` is never drafted, so acceptance drops where the target
        picks one. Training may use the same subset (`forward(..., restrict_vocab=True)`; `dspark train
        --draft_vocab_size K` picks the K most frequent response tokens).
        It is saved with the draft (`draft_vocab_ids` in `model.safetensors`, `draft_vocab_size` in the
        config); DeepSpec export drops it (with a warning).

        Args:
            token_ids (`Sequence[int]`, `torch.LongTensor` or `None`): unique ids in `[0, vocab_size)`, at
                least one; stored sorted. Pick them with [`dspark_hf.model.vocab.frequent_token_ids`], and include
                the EOS / end-of-turn tokens. `None` restores the full vocabulary.

        Returns:
            [`DSparkDraftModel`]: the draft itself.
        """
        if token_ids is None:
            self.draft_vocab_ids = None
            self.config.draft_vocab_size = None
            return self
        ids = validate_vocab_ids(token_ids, self.config.vocab_size)
        self.draft_vocab_ids = ids.to(self.device)
        self.config.draft_vocab_size = int(ids.numel())
        return self

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits over the draft vocabulary: `[..., K]` with a subset `S`, else `[..., V]` (= `lm_head`).

        Column `j` belongs to token `draft_vocab_ids[j]`; [`expand_draft_logits`] maps a row back to the full
        vocabulary. Inference only (the restricted LM-head rows are cached, not differentiated).
        """
        ids = self.draft_vocab_ids
        if ids is None:
            return self.lm_head(hidden)
        head = self._require_bound()[1]
        if type(head) is not nn.Linear:  # a wrapped or quantized head: exact, just no saving
            return self.lm_head(hidden)[..., ids.to(hidden.device)]
        weight = self._head_rows(head.weight, ids)
        bias = self._head_bias_rows(head.bias, ids) if head.bias is not None else None
        logits = self.functional_linear(hidden.to(weight.dtype), weight, bias)
        return self._softcap(logits.to(torch.promote_types(logits.dtype, torch.float32)))

    def functional_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`F.linear` for the LM-head rows this draft caches (a slice, not an `nn.Linear` module). The exact kernel
        mode (`dspark_hf.kernels`) swaps it per instance for its batch-invariant linear while it is active."""
        return nn.functional.linear(x, weight, bias)

    def expand_draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits `[..., K]` → full-vocabulary logits `[..., V]`, `-inf` outside the subset.

        The identity without a subset. Softmax of the result is the draft's distribution over the whole
        vocabulary (zero outside `S`), which is what verification must receive as `q`.
        """
        ids = self.draft_vocab_ids
        if ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., ids.to(logits.device)] = logits
        return full

    def full_vocab_logits(
        self, hidden: torch.Tensor, prev_embed: torch.Tensor | None, state: torch.Tensor | None
    ) -> torch.Tensor:
        """Unrestricted logits `U + B` `[..., V]` of one position (whatever the draft vocabulary).

        The fallback for a position where the logits processors leave no token of the subset (e.g.
        `suppress_tokens` covering it): sampling then proceeds from the full vocabulary at that position.
        """
        logits = self.lm_head(hidden)
        if self.markov_head is not None:
            logits = logits + self.markov_head.step(hidden, prev_embed, state)[0].to(logits.dtype)
        return logits

    def _check_loaded_draft_vocab(self, path: str) -> None:
        """After loading: a config with `draft_vocab_size` needs the ids in the weights (not the placeholder)."""
        ids = self.draft_vocab_ids
        if ids is None:
            return
        try:
            validate_vocab_ids(ids, self.config.vocab_size)
        except ValueError as err:
            raise ValueError(
                f"{path}: config.json sets draft_vocab_size={self.config.draft_vocab_size} but model.safetensors "
                f"holds no valid `draft_vocab_ids` ({err}). Re-save the draft after `set_draft_vocab(ids)`, or "
                "remove `draft_vocab_size` from config.json to use the full vocabulary."
            ) from None

    # ------------------------------------------------------------------ the three stages
    def project_context(self, target_hidden_states: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Fuse the selected target layers: `[B, T, m·d]` (or a list of `m` tensors `[B, T, d]`) → `[B, T, d]`."""
        if isinstance(target_hidden_states, (list, tuple)):
            target_hidden_states = torch.cat(list(target_hidden_states), dim=-1)
        expected = self.fc.in_features
        if target_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"Context features have width {target_hidden_states.shape[-1]}, expected {expected} "
                f"(= {self.config.num_target_features} target layers × hidden size {self.config.hidden_size})."
            )
        return self.hidden_norm(self.fc(target_hidden_states.to(self.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer keys/values of projected context `[B, T, d]` at `positions` `[B, T]`."""
        return [layer.self_attn.context_kv(context, positions) for layer in self.layers]

    def extend_context(self, stores, context: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed context to per-row stores (`dspark_hf.decoding.caches.KVStore`).

        Args:
            stores (`list[tuple[KVStore, int]]`): each row's store and its number of new tokens `n_r`; the rows'
                tokens lie one after another in `context`.
            context (`torch.Tensor` of shape `(1, Σ n_r, d)`): projected features ([`project_context`]).
            positions (`torch.LongTensor` of shape `(1, Σ n_r)`): each token's absolute position in its row.
        """
        kvs = self.context_kv(context, positions)  # per layer ([1, kv_heads, Σn, hd], ...)
        offset = 0
        for store, n in stores:
            store.append([(k[0, :, offset : offset + n], v[0, :, offset : offset + n]) for k, v in kvs])
            offset += n

    def run_backbone(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the draft layers over block embeddings `[B, S, d]`; return final-normed states `[B, S, d]`.

        `attention_mask` (`[B, 1, S, T + S]`, boolean, `True` = may attend) is only needed when several
        blocks share one forward (training); a single block sees all of its context and itself.
        """
        x = block_embeds.to(self.dtype)
        if not self.config.sample_from_anchor:
            x, positions, attention_mask = self._dflash_layout(x, positions, attention_mask)
        for layer, (keys, values) in zip(self.layers, context_kv):
            x = layer(x, positions, keys, values, attention_mask)
        if self.config.sample_from_anchor:
            return self.norm(x)
        # the anchor slot drafts nothing in this layout; an RNN head's state still runs through it (heads.RNNHead)
        bsz, length, width = x.shape
        x = self.norm(x).reshape(bsz, -1, self.config.block_size + 1, width)
        if isinstance(self.markov_head, RNNHead):
            self.markov_head.anchor_hidden = x[:, :, 0].reshape(-1, width)
        return x[:, :, 1:].reshape(bsz, -1, width)

    def _dflash_layout(
        self, x: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Blocks `[anchor, mask × (γ-1)]` → the DFlash layout's `[anchor, mask × γ]` (`sample_from_anchor=False`).

        Each block of `γ` slots gets one more mask slot at the next position, so that its slots `1..γ` draft the
        tokens at `anchor + 1 … anchor + γ`. The new slot's mask row and column are those of a slot of the same
        block (the masks this model is given treat a block's slots alike: same context, the whole block).
        """
        gamma = self.config.block_size
        bsz, length, width = x.shape
        blocks = length // gamma
        # torch.full, not torch.tensor: no host-to-device copy, so a CUDA-graph capture of the draft step holds
        mask_embed = self.embed_tokens(torch.full((1,), self.config.mask_token_id, device=x.device))
        x = torch.cat([x.reshape(bsz, blocks, gamma, width), mask_embed.expand(bsz, blocks, 1, width)], dim=2)
        pos = positions.reshape(bsz, blocks, gamma)
        positions = torch.cat([pos, pos[..., -1:] + 1], dim=2).reshape(bsz, -1)
        if attention_mask is not None:  # extended slot -> a slot of the same block in the given mask
            source = torch.arange(blocks * (gamma + 1), device=x.device)
            source = (source // (gamma + 1)) * gamma + (source % (gamma + 1)).clamp(max=gamma - 1)
            context = attention_mask.shape[-1] - length
            columns = torch.cat([torch.arange(context, device=x.device), context + source])
            attention_mask = attention_mask[:, :, source][..., columns]
        return x.reshape(bsz, -1, width), positions, attention_mask

    def forward(
        self,
        target_hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        prev_token_ids: torch.Tensor,
        context_position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        restrict_vocab: bool = False,
        **kwargs,
    ) -> DSparkOutput:
        """Teacher-forced forward over one or more blocks (training and analysis).

        Args:
            target_hidden_states (`torch.Tensor` of shape `(B, T, m·d)`): raw outputs of the selected target
                layers for the context tokens.
            input_ids (`torch.LongTensor` of shape `(B, N·γ)`): the blocks' inputs, each
                `[anchor, mask, …, mask]`.
            position_ids (`torch.LongTensor` of shape `(B, N·γ)`): absolute positions of the block slots
                (`anchor_pos + k`).
            prev_token_ids (`torch.LongTensor` of shape `(B, N·γ)`): the token before each predicted one
                (the anchor for slot 0, then the ground truth), read by the sequential/confidence heads.
            context_position_ids (`torch.LongTensor` of shape `(B, T)`, *optional*): defaults to `0..T-1`.
            attention_mask (`torch.BoolTensor` of shape `(B, 1, N·γ, T + N·γ)`, *optional*): see
                [`block_attention_mask`]; required when `N > 1`.
            restrict_vocab (`bool`, *optional*, defaults to `False`): compute the logits only over the draft
                vocabulary subset (`draft_vocab_ids`, see [`set_draft_vocab`]): `logits` / `base_logits` are then
                `[B, N·γ, K]`, column `j` being token `draft_vocab_ids[j]`. Training on a subset uses this: on a
                CPU the LM-head products dominate a training step, and they shrink by `V / K`.

        Returns:
            [`DSparkOutput`]
        """
        bsz, seq = input_ids.shape
        gamma = self.config.block_size
        if seq % gamma:
            raise ValueError(f"input_ids has {seq} slots, not a multiple of block_size={gamma}.")
        if seq > gamma and attention_mask is None:
            raise ValueError(
                "Several blocks in one forward need an attention_mask; build it with block_attention_mask()."
            )
        if context_position_ids is None:
            ctx_len = target_hidden_states.shape[1]
            context_position_ids = torch.arange(ctx_len, device=input_ids.device).expand(bsz, ctx_len)
        context = self.project_context(target_hidden_states)
        hidden = self.run_backbone(
            self.embed_tokens(input_ids), position_ids, self.context_kv(context, context_position_ids), attention_mask
        )
        vocab_ids = self.draft_vocab_ids if restrict_vocab else None
        if restrict_vocab and vocab_ids is None:
            raise ValueError("restrict_vocab=True needs a draft vocabulary subset; call set_draft_vocab(ids) first.")
        base_logits = self.lm_head(hidden) if vocab_ids is None else self.draft_logits(hidden)
        blocks_h = hidden.reshape(bsz * seq // gamma, gamma, -1)
        blocks_prev = prev_token_ids.reshape(bsz * seq // gamma, gamma)
        prev_embed = None
        logits = base_logits
        if self.markov_head is not None:
            bias, prev_embed = self.markov_head(blocks_h, blocks_prev, vocab_ids=vocab_ids)
            logits = base_logits + bias.reshape(bsz, seq, -1).to(base_logits.dtype)
            prev_embed = prev_embed.reshape(bsz, seq, -1)
        confidence_logits = None
        if self.confidence_head is not None:
            confidence_logits = self.confidence_head(hidden, prev_embed)
            confidence_logits = confidence_logits.to(torch.promote_types(confidence_logits.dtype, torch.float32))
        return DSparkOutput(
            logits=logits, base_logits=base_logits, confidence_logits=confidence_logits, hidden_states=hidden
        )


def block_attention_mask(anchor_positions: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """Mask for `N` blocks packed in one forward: block `j` sees context `< anchor_j` and its own block.

    Args:
        anchor_positions (`torch.LongTensor` of shape `(B, N)`): position of each block's anchor.
        context_length (`int`): `T`, the number of context tokens.
        block_size (`int`): γ.

    Returns:
        `torch.BoolTensor` of shape `(B, 1, N·γ, T + N·γ)`, `True` where attention is allowed.
    """
    bsz, n = anchor_positions.shape
    device = anchor_positions.device
    ctx = torch.arange(context_length, device=device)
    # [B, N, T]: context visible to block j
    see_ctx = ctx[None, None, :] < anchor_positions[:, :, None]
    see_ctx = see_ctx.repeat_interleave(block_size, dim=1)
    block_id = torch.arange(n * block_size, device=device) // block_size
    see_blk = (block_id[:, None] == block_id[None, :]).expand(bsz, -1, -1)
    return torch.cat([see_ctx, see_blk], dim=-1)[:, None]


def load_deepspec_checkpoint(
    path_or_repo: str,
    revision: str | None = None,
    token: Any = None,
    dtype: torch.dtype | str | None = None,
    target: Any = None,
    **unused: Any,
) -> DSparkDraftModel:
    """Load a DeepSpec-format draft (folder or Hub id) as a [`DSparkDraftModel`].

    Args:
        path_or_repo (`str`): local folder or Hub repo id.
        revision (`str`, *optional*): branch, tag or commit on the Hub.
        token (*optional*): Hub token.
        dtype (`torch.dtype` or `str`, *optional*): cast the weights; defaults to the stored dtype.
        target (`PreTrainedModel`, *optional*): bind the draft to this target.
    """
    path_or_repo = os.fspath(path_or_repo)
    config, weights = read_deepspec_checkpoint(path_or_repo, revision, token)
    return _draft_from_weights(config, weights, path_or_repo, dtype, target, "DeepSpec")


def load_speculators_checkpoint(
    path_or_repo: str,
    revision: str | None = None,
    token: Any = None,
    dtype: torch.dtype | str | None = None,
    target: Any = None,
    **unused: Any,
) -> DSparkDraftModel:
    """Load a speculators-format DSpark (or DFlash) draft (folder or Hub id) as a [`DSparkDraftModel`].

    A draft vocabulary (`draft_vocab_size` below the vocabulary) becomes the draft's vocabulary subset
    (`set_draft_vocab`). See `docs/speculators-format.md`.

    Args:
        path_or_repo (`str`): local folder or Hub repo id.
        revision (`str`, *optional*): branch, tag or commit on the Hub.
        token (*optional*): Hub token.
        dtype (`torch.dtype` or `str`, *optional*): cast the weights; defaults to the stored dtype.
        target (`PreTrainedModel`, *optional*): bind the draft to this target.
    """
    path_or_repo = os.fspath(path_or_repo)
    config, weights, vocab_ids = read_speculators_checkpoint(path_or_repo, revision, token)
    return _draft_from_weights(config, weights, path_or_repo, dtype, target, "speculators", vocab_ids)


def _draft_from_weights(
    config, weights, source: str, dtype, target, fmt: str, vocab_ids: torch.Tensor | None = None
) -> DSparkDraftModel:
    """A draft for `config` holding exactly `weights` (every key and shape must match), with the draft
    vocabulary `vocab_ids` (if any), bound to `target`."""
    stored_dtype = next(v.dtype for v in weights.values() if v.is_floating_point())
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    draft = DSparkDraftModel(config).to(dtype or stored_dtype)
    load_exact_weights(draft, weights, source, fmt)
    draft.eval()
    if vocab_ids is not None:
        draft.set_draft_vocab(vocab_ids)
    if target is not None:
        draft.bind_target(target)
    return draft
