"""The drafting round of `generate()` (R = 1) in three compiled calls, for a draft on the exact CPU kernels.

After the target's verification forward has streamed its ~0.5 GB of weights through the CPU's caches, every
PyTorch call the draft makes starts cold: on the 2-core CPU of `docs/cpu-packing.md` the eager round (ingest,
backbone, LM head rows, sequential and confidence heads; a few hundred operations) took ~5 ms, about a quarter
of a target forward, while its ~40 MB of weights take ~1.5 ms to read. [`CompiledRound`] runs the same steps in
the exact kernels' extension (`exact_kernels.cpp`):

1. `draft_ingest`: the context projection and norm of newly committed target features, and each draft layer's
   keys and values for them, written in place into the round's [`KVStore`];
2. `draft_block_run`: the block `[anchor, mask × (γ-1)]` through the draft's layers (the block's own keys and
   values go after the context in the same buffers, as scratch), the final norm and the LM head rows;
3. `markov_greedy` (greedy rounds without logits processors): the Markov head's bias, the argmax and the
   confidence logit, position by position.

They call the kernels the exact mode's eager path calls for the draft (the lean layer calls, the compiled
RMSNorm, the exact linear kernel; the rotation from the same cos/sin values), in the same order, so drafted tokens,
base logits and confidence logits equal the eager path's bit for bit (`tests/decoding/test_compiled_round.py`). Sampling
rounds use steps 1-2 and the eager sequential head. Whatever the draft proposes, verification is the target's:
output never depends on this module.

Used when [`CompiledRound.create`] accepts the draft: the extension is built, the draft's layers run the exact
mode's lean path (inside `exact_kernels`, Qwen3-style layers, default rotary), and its heads are the plain Markov /
confidence heads (or none). Anything else drafts eagerly, as before.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .._transformers import forward_hooks, has_forward_pre_hooks
from ..kernels import is_exact, is_exact_bf16, is_exact_norm, is_lean, lean_arguments, lean_bf16
from ..kernels.build import backend as exact_backend
from ..model.heads import ConfidenceHead, MarkovHead
from .caches import KVStore


def _free_stack(backend, handle: int) -> None:
    backend.stack_free(handle)


class CompiledRound:
    """The compiled drafting round of one `generate()` call; see the module docs. Build with [`create`]."""

    def __init__(self, draft, backend, max_tokens: int) -> None:
        self.draft = draft
        self.backend = backend
        self.gamma = draft.config.block_size
        self.mask_id = draft.config.mask_token_id
        embed, head = draft._require_bound()[:2]
        self.embed = embed.weight.detach()
        self.head = head
        self.fc_weight = draft.fc.weight.detach()
        self.fc_bias = None if draft.fc.bias is None else draft.fc.bias.detach()
        self.hidden_norm = (draft.hidden_norm.weight.detach(), draft.hidden_norm.eps)
        self.norm = (draft.norm.weight.detach(), draft.norm.eps)
        handle = 0
        for layer in draft.layers:
            norm_etc, head_counts, post_attention = lean_arguments(layer)
            handle = backend.stack_add_layer(handle, *norm_etc, *head_counts, *post_attention)
        self.handle = handle
        weakref.finalize(self, _free_stack, backend, handle)
        # cos/sin of the draft's rotation at every position a round can reach, computed once by the draft's own
        # RotaryEmbedding (the eager path computes the same values per call)
        positions = torch.arange(max_tokens + self.gamma, device=draft.device)[None]
        cos, sin = draft.layers[0].self_attn.rotary.cos_sin(positions, torch.float32)
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        self.kv_heads = draft.layers[0].self_attn.num_kv_heads
        self.head_dim = draft.layers[0].self_attn.head_dim
        markov, conf = draft.markov_head, draft.confidence_head
        self.markov = markov
        self.conf_weight = conf.proj.weight.detach().reshape(-1) if conf is not None else torch.empty(0)
        self.conf_bias = None if conf is None or conf.proj.bias is None else conf.proj.bias.detach()
        self.conf_markov = conf is not None and conf.with_markov
        self.capacity = max_tokens + self.gamma
        self.bf16 = is_exact_bf16(draft.fc)  # the exact-bf16 mode: every linear of the round on the bf16 GEMM

    @staticmethod
    def available() -> bool:
        """Whether the exact kernels' extension (which holds the compiled calls) is built."""
        return exact_backend() is not None

    @classmethod
    def create(cls, draft, max_tokens: int) -> CompiledRound | None:
        """The compiled round for `draft` (bound, inside `exact_kernels`), or `None` where it does not apply."""
        backend = exact_backend()
        if backend is None or not eligible(draft):
            return None
        return cls(draft, backend, max_tokens)

    # ------------------------------------------------------------------ steps
    def _buffers(self, store: KVStore, needed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        store.reserve(
            needed,
            len(self.draft.layers),
            self.kv_heads,
            self.head_dim,
            torch.float32,
            self.draft.device,
            self.capacity,
        )
        return store._keys, store._values

    def ingest(self, store: KVStore, features: torch.Tensor) -> None:
        """Append committed target features `[n, m·d]` to the draft's context (step 1)."""
        n = features.shape[0]
        if n == 0:
            return
        keys, values = self._buffers(store, len(store) + n)
        self.backend.draft_ingest(
            self.handle,
            features.to(self.draft.device, torch.float32),
            self.fc_weight,
            self.fc_bias,
            *self.hidden_norm,
            keys,
            values,
            len(store),
            self.cos,
            self.sin,
            self.bf16,
        )
        store.length += n

    def block(self, store: KVStore, anchor: int, positions: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's final states `[P, d]` and base logits `[P, K]` (step 2), `P = min(γ, positions)`."""
        rows = self.gamma if positions is None else min(self.gamma, positions)
        keys, values = self._buffers(store, len(store) + self.gamma)
        weight = self.head.weight
        ids = self.draft.draft_vocab_ids
        if ids is not None:
            weight = self.draft._head_rows(weight, ids)
            bias = self.draft._head_bias_rows(self.head.bias, ids) if self.head.bias is not None else None
        else:
            bias = self.head.bias
        return self.backend.draft_block_run(
            self.handle,
            self.embed,
            anchor,
            self.mask_id,
            self.gamma,
            keys,
            values,
            len(store),
            self.cos,
            self.sin,
            rows,
            *self.norm,
            weight.detach(),
            None if bias is None else bias.detach(),
            self.bf16,
        )

    def greedy(
        self, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The greedy sequential and confidence heads (step 3): tokens `[P]` and confidence logits `[P]` (or `None`)."""
        ids = self.draft.draft_vocab_ids
        if self.markov is not None:
            w1 = self.markov.markov_w1.weight.detach()
            w2 = self.markov.markov_w2.weight
            w2 = self.markov._w2_rows(w2, ids) if ids is not None else w2.detach()
        else:
            w1 = w2 = torch.empty(0)
        tokens, conf = self.backend.markov_greedy(
            base_logits,
            hidden,
            anchor,
            w1,
            w2,
            ids if ids is not None else torch.empty(0, dtype=torch.long),
            self.conf_weight,
            self.conf_bias,
            self.conf_markov,
            self.bf16,
        )
        return tokens, (conf if self.conf_weight.numel() else None)


def eligible(draft) -> bool:
    """Whether [`CompiledRound`] computes exactly what `draft`'s eager round computes (see the module docs)."""
    config = draft.config
    embed, head = draft._require_bound()[:2] if draft.is_bound else (None, None)
    markov, conf = draft.markov_head, draft.confidence_head
    return (
        embed is not None
        and config.layer_style == "qwen3"
        and getattr(config, "final_logit_softcapping", None) is None
        and draft.device.type == "cpu"
        and draft.dtype == torch.float32
        and len(draft.layers) > 0
        and all(is_lean(layer) and lean_arguments(layer) is not None for layer in draft.layers)
        and is_exact_norm(draft.hidden_norm)
        and is_exact_norm(draft.norm)
        and is_exact(draft.fc)
        and not forward_hooks(draft.fc)
        and not has_forward_pre_hooks(draft.fc)
        and isinstance(embed, nn.Embedding)
        and embed.weight.dtype == torch.float32
        and type(head) is nn.Linear
        and head.weight.dtype == torch.float32
        and head.weight.device.type == "cpu"
        # without a subset the eager round calls the target's head module: it must be on the exact kernel too
        and (draft.draft_vocab_ids is not None or is_exact(head))
        and (markov is None or type(markov) is MarkovHead)
        and (conf is None or type(conf) is ConfidenceHead)
        # one precision for the whole round (the exact mode's float32 GEMM or the exact-bf16 mode's bf16 one)
        and all(lean_bf16(layer) == is_exact_bf16(draft.fc) for layer in draft.layers)
        and (draft.draft_vocab_ids is not None or is_exact_bf16(head) == is_exact_bf16(draft.fc))
    )
