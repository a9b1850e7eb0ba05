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

from dataclasses import dataclass, field

import torch

from ..scheduling.payoff import PayoffGuard

#: Whether a driver looks up before drafting when neither the call, its generation config nor the draft's own
#: defaults say (the library's default in `dspark_hf.decoding.options.resolve_options`).
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

    The reference definition of the lookup, a whole-sequence search: no driver calls it (both search the
    incremental [`LookupIndex`], which `tests/decoding/test_lookup.py` checks gives this answer at every length).

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


@dataclass
class LookupGate(PayoffGuard):
    """The engine's measured payoff guard for copies ([`PayoffGuard`], whose rules it follows): whether rounds that
    verify copies emit more per second than the rounds that do not, per batch size.

    At batch 1 a copy is nearly free (a forward over a few more tokens costs little more than over one), and it
    is always allowed there; but a batch's forward already computes one token per request, and in the padded layout one row's copy widens
    every row. So [`DSparkEngine`] records, per number of requests, the tokens emitted and seconds spent by
    rounds that verified a copy (the guard's "trying" rounds) and by rounds that did not, and stops copying at a
    batch size once `after` copy rounds there (and one other round) have not emitted `margin` more tokens per
    second than the others. A verdict against copying also stands for every larger batch size that has not
    measured a gain of its own. While copying is off at a size it is tried again in one round (a probe) after
    `explore` rounds, the wait doubling after every probe that does not turn the comparison, up to `explore_max`.

    The gate also keeps how often a copied token is accepted at each position once the ones before it were
    ([`survival`], from `prior` with `prior_weight` pseudo-rounds), which the engine weighs against the SPS
    profile's cost of the wider forward before a copy round (see `DSparkEngine`'s `lookup`).

    Args:
        after, margin, smoothing, plain_smoothing, probe_weight, explore, explore_max: the guard's, see
            [`PayoffGuard`] (`after=0`: no verdict, copying is always allowed).
        prior (`float`, *optional*, defaults to 0.5): acceptance of a copied token assumed before any was verified.
        prior_weight (`float`, *optional*, defaults to 2.0): pseudo-count of that prior, per position.
    """

    min_plains: int = 1
    prior: float = 0.5
    prior_weight: float = 2.0
    verified_at: list = field(default_factory=list)  # copied tokens verified at position k (their prefix accepted)
    accepted_at: list = field(default_factory=list)  # ... and accepted

    def allows(self, rows: int) -> bool:
        """Whether a round of `rows` requests may verify copies (`True` also marks a probe when it is one).

        One row is always allowed: its copy is verified like a draft and widens no other row's forward (the
        reason for the guard), and gating it measured fewer copy rounds and a lower τ in `generate()` (τ 2.63 ->
        2.40 on eight GSM8K prompts, greedy, the shipped draft; `docs/policies.md`).
        """
        self.probing = False
        if rows == 1 or not self.vetoed(rows):
            return True
        if self.probe_due(rows):
            self.probing = True
            return True
        return False

    def observe(self, rows: int, copied: bool, tokens: int, seconds: float) -> None:
        """Add a round of `rows` requests that emitted `tokens` in `seconds` (`copied`: it verified a copy)."""
        if seconds <= 0:
            return
        self.add_round(rows, copied, tokens, seconds, probe=self.probing)
        self.since[rows] = 0 if copied else self.since.get(rows, 0) + 1
        if self.probing:
            self.end_probe(rows)

    def record(self, verified: int, accepted: int) -> None:
        """One request's copy: `verified` copied tokens went to the target, the first `accepted` survived."""
        grow = max(0, min(verified, accepted + 1) - len(self.verified_at))
        self.verified_at += [0] * grow
        self.accepted_at += [0] * grow
        for k in range(min(verified, accepted + 1)):  # position k was decided only if the ones before it held
            self.verified_at[k] += 1
            self.accepted_at[k] += accepted > k

    def survival(self, copies: list[list[int]]) -> torch.Tensor:
        """Expected accepted copied tokens per position, averaged over all rows (a row without a copy adds 0):
        `s_j = mean_r P(row r's first j+1 copied tokens are accepted)`, for `j < ` the longest copy."""
        width = max(map(len, copies))
        rate = []
        for k in range(width):
            seen = self.verified_at[k] if k < len(self.verified_at) else 0
            kept = self.accepted_at[k] if k < len(self.accepted_at) else 0
            rate.append((kept + self.prior * self.prior_weight) / (seen + self.prior_weight))
        prefix = torch.tensor(rate, dtype=torch.float64).cumprod(0)
        total = torch.zeros(width, dtype=torch.float64)
        for copy in copies:
            total[: len(copy)] += prefix[: len(copy)]
        return total / len(copies)


class LookupIndex:
    """An incremental n-gram index of one growing sequence (a request's prompt and output): the same answer as
    [`lookup_continuation`] on the whole sequence, at a cost proportional to the tokens added since the last call
    instead of the sequence's length (the engine keeps one per request).

    Args:
        prompt (`list[int]`): the sequence's first tokens.
        config ([`LookupConfig`]): the search settings.
    """

    def __init__(self, prompt: list[int], config: LookupConfig) -> None:
        self.config = config
        self.ids = list(prompt)
        self._prompt = len(self.ids)
        # n -> {n-gram: end (exclusive) of its latest occurrence}, for every n-gram that ends before the last token
        self._ends = {n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self._indexed = 0  # n-grams ending at positions 1.._indexed are in `_ends`
        self.start = 0  # where the last copy [`continuation`] returned starts in the sequence

    def continuation(self, generated: list[int], limit: int | None = None) -> list[int]:
        """The copy for the sequence `prompt + generated` (`generated` extends what earlier calls saw)."""
        ids = self.ids
        ids.extend(generated[len(ids) - self._prompt :])
        length = len(ids)
        for end in range(self._indexed + 1, length):  # the suffix itself (ending at `length`) is not a match
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(ids[end - n : end])] = end
        self._indexed = max(self._indexed, length - 1)
        cap = self.config.max_tokens if limit is None else min(self.config.max_tokens, limit)
        if cap < 1:
            return []
        for n in range(min(self.config.max_ngram, length - 1), self.config.min_ngram - 1, -1):
            end = self._ends[n].get(tuple(ids[length - n :]))
            if end is not None:
                self.start = end  # where the copy starts in the sequence (a driver may slice it on the device)
                return ids[end : end + cap]
        return []
