"""Prompt lookup as a second proposer inside a DSpark round: copy what followed the latest earlier occurrence
of the sequence's last few tokens.

Text often repeats itself (a GSM8K answer restates the numbers of the question, code repeats its identifiers,
a rewrite copies its source). Where the context already holds the continuation, copying it costs no draft
forward at all, and a draft trained on ~1k conversations predicts such spans worse than the copy does
(measured on the default pair: prompt lookup alone ran 1.15x plain decoding on the exact kernels, the draft
1.07x, `docs/results.md`). So a round first looks for a match; only where there is none does the policy decide
whether the draft drafts. Verification is unchanged, so output stays exactly the target's: greedy rounds
keep the longest prefix the target agrees with; sampled rounds treat the copy as a deterministic proposal
(accepted with the target's own probability of each token, the rest resampled from the target), as
transformers' prompt lookup decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Whether `generate(assistant_model=draft)` looks up before drafting when neither the call, its generation
#: config nor the draft (`draft.lookup`) says.
DEFAULT_LOOKUP = False


@dataclass(frozen=True)
class LookupConfig:
    """How the lookup proposer searches.

    Args:
        max_tokens (`int`, *optional*, defaults to 7): the most tokens a match proposes (at most the draft's γ in a
            round, so a round never verifies more than a drafted one could).
        max_ngram (`int`, *optional*, defaults to 3): the longest suffix searched for.
        min_ngram (`int`, *optional*, defaults to 2): the shortest suffix that counts as a match (a single
            repeated token predicts its successor poorly; the draft does better there).
    """

    max_tokens: int = 7
    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise ValueError(f"LookupConfig needs max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {self}.")


def resolve_lookup(spec) -> LookupConfig | None:
    """A lookup setting from its user-facing forms: `None`/`False`/`"off"` (no lookup), `True`/`"on"` (the
    defaults), an `int` (`max_tokens`), or a [`LookupConfig`]."""
    if spec is None or spec is False or spec == "off":
        return None
    if spec is True or spec == "on":
        return LookupConfig()
    if isinstance(spec, LookupConfig):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        return LookupConfig(max_tokens=spec) if spec > 0 else None
    raise ValueError(f"dspark_lookup must be True/False, 'on'/'off', a token count or a LookupConfig, got {spec!r}.")


def lookup_continuation(ids: torch.Tensor, config: LookupConfig, limit: int | None = None) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the sequence's last `n` tokens, for the
    largest `n` in `[config.min_ngram, config.max_ngram]` that occurs, at most `min(config.max_tokens, limit)` of
    them; `[]` when no suffix recurs.

    Args:
        ids (`torch.LongTensor`): the sequence so far, `[T]` (any device; searched on the CPU).
        config ([`LookupConfig`]): the search settings.
        limit (`int`, *optional*): a tighter cap on the proposal's length (the round's budget).
    """
    cap = config.max_tokens if limit is None else min(config.max_tokens, limit)
    ids = ids.reshape(-1).cpu()
    length = ids.shape[0]
    if cap < 1:
        return []
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        # every earlier window of n tokens that is followed by at least one token (the suffix itself is excluded)
        windows = ids[: length - 1].unfold(0, n, 1)
        hits = (windows == ids[length - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # the most recent occurrence: nearby text repeats most faithfully
            return ids[start : start + cap].tolist()
    return []
