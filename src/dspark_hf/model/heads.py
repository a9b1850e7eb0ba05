"""The two lightweight heads that sit on top of the draft backbone.

* **Sequential heads** add a prefix-dependent bias `B_k` to the backbone's base logits `U_k`, so a block
  drafted in one parallel pass is still sampled left to right: `q_k = softmax(U_k + B_k(x_{k-1}, ...))`.
  `markov` (a low-rank transition table), `gated` (the transition modulated by the hidden state) and
  `rnn` (a small recurrent state over the block) trade a little compute for more context.
* The **confidence head** predicts `c_k`, the probability that drafted token `k` survives verification
  given that every earlier one did. It reads the hidden state and, optionally, the previous token's
  Markov embedding; never the token `x_k` it judges, which is what keeps scheduling on it lossless.

Each head works in two modes: `step` (one position, inference) and `forward` (a whole block with teacher
forcing, training). Both compute the same function; a test checks that. At inference the sequential head's
bias can be restricted to a draft vocabulary subset (`vocab_ids`, see `dspark_hf.model.vocab`): only those
columns of the `r × V` output projection are computed; training can use the same subset (`forward(vocab_ids=...)`).
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration import DSparkConfig
from .vocab import SubsetRows


class MarkovHead(nn.Module):
    """First-order low-rank transition bias: `B_k = W2 · W1[x_{k-1}]`, independent of the hidden state.

    Weight names follow DeepSpec's checkpoints (`markov_w1`, `markov_w2`) so import/export is a rename-free
    copy.
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        self._w2_rows = SubsetRows()  # W2[S] of the draft vocabulary, gathered once (not a parameter)

    def init_state(self, batch: int, ref: torch.Tensor) -> torch.Tensor | None:
        """Recurrent state before the first position (`None`: this head has none)."""
        return None

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """`W1[x_{k-1}]`: the previous token's transition embedding, `[..., r]`."""
        return self.markov_w1(prev_tokens)

    def features(
        self, hidden: torch.Tensor, prev_embed: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position, before the output projection: returns the rank-`r` feature and the next state."""
        return prev_embed, state

    def project(self, features: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`W2 · feature`: the logit bias `[..., V]`. The only `r × V` product, so it is kept separate: a
        whole block's features can be projected in one pass over `W2` instead of one pass per position.

        With `vocab_ids` (`torch.LongTensor` `[K]`, a draft vocabulary subset) only those columns are
        computed: `[..., K]`, equal to `project(features)[..., vocab_ids]` up to float rounding.
        """
        if vocab_ids is None:
            return self.markov_w2(features)
        return self.functional_linear(features, self._w2_rows(self.markov_w2.weight, vocab_ids))

    def functional_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`F.linear` for the `W2` rows this head caches (a slice, not an `nn.Linear` module). The exact kernel
        mode (`dspark_hf.kernels`) swaps it per instance for its batch-invariant linear while it is active."""
        return nn.functional.linear(x, weight, bias)

    def step(
        self,
        hidden: torch.Tensor,
        prev_embed: torch.Tensor,
        state: torch.Tensor | None,
        vocab_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: returns the logit bias `[..., V]` (`[..., K]` with `vocab_ids`) and the next state."""
        feature, state = self.features(hidden, prev_embed, state)
        return self.project(feature, vocab_ids), state

    def block_features(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """Features of a whole block with the given previous tokens.

        Args:
            hidden (`torch.Tensor` of shape `(N, γ, d)`): backbone states.
            prev_tokens (`torch.LongTensor` of shape `(N, γ)`): the token before each position.

        Returns:
            features `(N, γ, r)`, previous-token embeddings `(N, γ, r)`, and the state after each position.
        """
        prev_embed = self.embed(prev_tokens)
        state = self.init_state(hidden.shape[0], hidden)
        features, states = [], []
        for k in range(hidden.shape[1]):
            feature, state = self.features(hidden[:, k], prev_embed[:, k], state)
            features.append(feature)
            states.append(state)
        return torch.stack(features, dim=1), prev_embed, states

    def forward(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced block. `hidden`: `[N, γ, d]`, `prev_tokens`: `[N, γ]` → (bias `[N, γ, V]`, embeds).

        With `vocab_ids` the bias covers only those columns (`[N, γ, K]`); training on a vocabulary subset
        uses this (gradients flow to the selected rows of `W2`).
        """
        features, prev_embed, _ = self.block_features(hidden, prev_tokens)
        return self.project(features, vocab_ids), prev_embed


class GatedMarkovHead(MarkovHead):
    """Markov transition scaled by a gate that reads the hidden state: `B_k = W2 · (g ⊙ W1[x_{k-1}])`."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size + config.markov_rank, config.markov_rank)

    def features(self, hidden, prev_embed, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embed], dim=-1)))
        return gate * prev_embed, state


class RNNHead(MarkovHead):
    """A gated recurrent state over the block: `z = [s_{k-1}; W1[x_{k-1}]; h_k]` → gate, candidate, output.

    `s_k = σ(g) ⊙ s_{k-1} + (1 − σ(g)) ⊙ tanh(c)`, `B_k = W2 · tanh(o)`, `s_0 = 0`.

    In the DFlash block layout (`sample_from_anchor=False`) the state also runs through the anchor slot, which
    drafts nothing but reads the anchor like the first drafted slot does (speculators trains it so). The backbone
    leaves that slot's final states in `anchor_hidden` ([`DSparkDraftModel.run_backbone`]); the state before the
    first position is then `[0 ; h_anchor]`, and the first [`features`] call takes the anchor slot's step first.
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        r = config.markov_rank
        self.joint_proj = nn.Linear(2 * r + config.hidden_size, 3 * r)
        self.anchor_hidden: torch.Tensor | None = None  # [N, d], set by the backbone in the DFlash layout only

    def init_state(self, batch: int, ref: torch.Tensor) -> torch.Tensor:
        state = ref.new_zeros(batch, self.rank)
        if self.anchor_hidden is None:
            return state
        return torch.cat([state, self.anchor_hidden.reshape(batch, -1).to(ref.dtype)], dim=-1)

    def features(self, hidden, prev_embed, state):
        if state.shape[-1] != self.rank:  # `[0 ; h_anchor]`: the anchor slot's step, with the same previous token
            _, state = self._step(state[..., self.rank :], prev_embed, state[..., : self.rank])
        return self._step(hidden, prev_embed, state)

    def _step(self, hidden, prev_embed, state):
        gate, cand, out = self.joint_proj(torch.cat([state, prev_embed, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return torch.tanh(out), state


SEQUENTIAL_HEAD_CLASSES = {"markov": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


class ConfidenceHead(nn.Module):
    """`z_k = w · [h_k ; W1[x_{k-1}]] + b`; the survival estimate is `σ(z_k / T_k)`.

    Returns logits, not probabilities: calibration (temperature per position) and the BCE loss both want
    logits.
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        extra = config.markov_rank if config.uses_markov_feature else 0
        self.with_markov = config.uses_markov_feature
        self.proj = nn.Linear(config.hidden_size + extra, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """`hidden`: `[..., d]`, `prev_embed`: `[..., r]` (or `None`) → confidence logits `[...]`."""
        features = torch.cat([hidden, prev_embed], dim=-1) if self.with_markov else hidden
        return self.proj(features).squeeze(-1)
