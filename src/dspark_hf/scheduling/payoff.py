"""The payoff guard: does trying something (drafting, or verifying a prompt-lookup copy) really emit more tokens
per second than the plain rounds around it? Measured per batch size, written once.

Three deciders weigh a costlier kind of round against plain decoding with this same bandit:
[`AdaptivePolicy`] (drafting at a fixed length), [`UniformHardwareAwarePolicy`]'s guard (drafting at a planned
length) and the engine's [`LookupGate`] (copy rounds). Each of them keeps, per number of rows `R`:

* **decayed rates**: tokens emitted and seconds spent by rounds that tried and by plain rounds, as sums that decay
  each time a round is added (a ratio of sums, not a mean of noisy per-round ratios), so the rates are recent;
* **a veto**: once `after` trying rounds at `R` have been measured, trying stops there unless it emitted `margin`
  more tokens per second than plain rounds; the verdict also stands for every larger `R` that has not measured a
  gain of its own ([`PayoffGuard.vetoed_below`]);
* **a doubling probe**: while vetoed, one trying round after `explore` waited rounds; a probe that does not turn
  the comparison doubles the wait (up to `explore_max`), one that does resets it. A probe's round decays the
  trying sums by `probe_weight` (more than an ordinary round) so that one good probe can turn the verdict.

The guard holds the state (the per-size sums, the waits, the rounds waited, whether this round is a probe) and
the rules; *what* counts as a waited round and *when* to probe stays with each decider (they differ, and the
tests in `tests/scheduling/test_scheduler_adaptive.py`, `tests/scheduling/test_scheduler_uniform.py` and `tests/decoding/test_engine_lookup.py`
pin their decisions).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PayoffState:
    """What the guard has measured at one batch size: tokens emitted and seconds spent by trying rounds and by
    plain rounds (decayed sums), how many of each it has seen, and the trying rounds since the last plain one."""

    draft_tokens: float = 0.0
    draft_seconds: float = 0.0
    plain_tokens: float = 0.0
    plain_seconds: float = 0.0
    drafts: int = 0
    plains: int = 0
    streak: int = 0  # trying rounds since the last plain round
    draft_weight: float = 0.0  # the trying rounds, decayed like their sums (seconds / weight: seconds per round)
    plain_weight: float = 0.0

    def add(self, drafted: bool, tokens: float, seconds: float, keep: float) -> None:
        """Add a round (`tokens` emitted in `seconds`) to the trying or the plain sums, the old sums kept at
        weight `keep`."""
        if drafted:
            self.draft_tokens = keep * self.draft_tokens + tokens
            self.draft_seconds = keep * self.draft_seconds + seconds
            self.draft_weight = keep * self.draft_weight + 1
            self.drafts += 1
        else:
            self.plain_tokens = keep * self.plain_tokens + tokens
            self.plain_seconds = keep * self.plain_seconds + seconds
            self.plain_weight = keep * self.plain_weight + 1
            self.plains += 1

    @property
    def draft_rate(self) -> float:
        return self.draft_tokens / self.draft_seconds if self.draft_seconds > 0 else 0.0

    @property
    def plain_rate(self) -> float:
        return self.plain_tokens / self.plain_seconds if self.plain_seconds > 0 else 0.0

    @property
    def stake(self) -> float | None:
        """What a trying round costs over a plain one, as a share of the plain round's time (`0.2`: 20% longer),
        from the decayed sums; `None` until both kinds were measured."""
        if self.draft_weight <= 0 or self.plain_weight <= 0 or self.plain_seconds <= 0:
            return None
        per_try = self.draft_seconds / self.draft_weight
        per_plain = self.plain_seconds / self.plain_weight
        return max(0.0, per_try / per_plain - 1.0)


@dataclass
class PayoffGuard:
    """The measured payoff of trying rounds against plain ones, per batch size (see the module docs).

    Args:
        after (`int`, *optional*, defaults to 4): trying rounds measured at a batch size before a verdict there;
            `0` or `None`: no verdict (never vetoed).
        margin (`float`, *optional*, defaults to 0.1): how much more per second trying rounds must emit to pay.
        min_plains (`int`, *optional*, defaults to 0): plain rounds measured at a batch size before a verdict.
        smoothing (`float`, *optional*, defaults to 0.1): decay of the trying sums per trying round.
        plain_smoothing (`float`, *optional*, defaults to 0.05): decay of the plain sums per plain round.
        probe_weight (`float`, *optional*, defaults to 0.5): decay of the trying sums at a probe.
        explore (`int`, *optional*, defaults to 16): rounds waited before the first probe at a batch size.
        explore_max (`int`, *optional*, defaults to 256): the longest wait between probes.
        scale_by_stake (`bool`, *optional*, defaults to `False`): scale the margin and the waits at a batch size by
            what a trying round costs there over a plain one ([`PayoffState.stake`], capped at 1): where trying
            costs 20% of a round (one request on a CPU: a few more tokens in a memory-bound forward), a wrong
            verdict either way costs little, so the margin is a fifth of `margin` and a probe comes after a fifth
            of the wait; where it costs a whole round or more (a batch), both are as set.
    """

    after: int | None = 4
    margin: float = 0.1
    min_plains: int = 0
    smoothing: float = 0.1
    plain_smoothing: float = 0.05
    probe_weight: float = 0.5
    explore: int = 16
    explore_max: int = 256
    scale_by_stake: bool = False
    states: dict = field(default_factory=dict)  # rows -> PayoffState
    waits: dict = field(default_factory=dict)  # rows -> rounds to wait before the next probe
    since: dict = field(default_factory=dict)  # rows -> rounds waited (what counts is the decider's choice)
    probing: bool = False  # whether the current round is a probe

    # ------------------------------------------------------------------ the verdict
    def settled(self, state: PayoffState | None) -> bool:
        """Whether `state` has measured enough rounds to judge."""
        return bool(self.after) and state is not None and state.drafts >= self.after and state.plains >= self.min_plains

    def scale(self, state: PayoffState | None) -> float:
        """The factor on the margin and the waits at a batch size: 1, or with `scale_by_stake` the measured
        [`PayoffState.stake`] capped at 1 (1 until it is measured)."""
        stake = state.stake if self.scale_by_stake and state is not None else None
        return 1.0 if stake is None else min(1.0, stake)

    def pays(self, state: PayoffState) -> bool:
        """Whether trying rounds in `state` emitted more per second than plain ones, by the margin."""
        return state.draft_rate > (1 + self.margin * self.scale(state)) * state.plain_rate

    def vetoed_here(self, rows: int) -> bool:
        """Trying measured a loss at `rows` itself."""
        state = self.states.get(rows)
        return self.settled(state) and not self.pays(state)

    def vetoed_below(self, rows: int) -> bool:
        """Trying measured a loss at a batch size smaller than `rows`, and `rows` measured no gain of its own."""
        own = self.states.get(rows)
        if self.settled(own) and self.pays(own):
            return False
        return any(r < rows and self.settled(s) and not self.pays(s) for r, s in self.states.items())

    def vetoed(self, rows: int) -> bool:
        """Trying measured a loss at `rows`, or below it while `rows` measured no gain of its own."""
        return self.vetoed_here(rows) or self.vetoed_below(rows)

    # ------------------------------------------------------------------ probes and measurements
    def probe_due(self, rows: int) -> bool:
        """Whether `rows` has waited long enough for its next probe."""
        wait = self.waits.get(rows, self.explore)
        if self.scale_by_stake:
            wait = max(1, round(wait * self.scale(self.states.get(rows))))
        return self.since.get(rows, 0) >= wait

    def add_round(self, rows: int, tried: bool, tokens: float, seconds: float, probe: bool = False) -> PayoffState:
        """Add a round at `rows` that emitted `tokens` in `seconds` (`tried`: a drafting / copy round; `probe`:
        it was a probe) to the decayed sums; returns the size's state."""
        state = self.states.setdefault(rows, PayoffState())
        if tried:
            keep = 1 - (self.probe_weight if probe else self.smoothing)
        else:
            keep = 1 - self.plain_smoothing
        state.add(tried, tokens, seconds, keep)
        return state

    def end_probe(self, rows: int) -> None:
        """After a probe's round is recorded: a probe that turned the comparison resets the wait, else it doubles."""
        state = self.states.get(rows)
        wait = self.waits.get(rows, self.explore)
        self.waits[rows] = self.explore if state is not None and self.pays(state) else min(2 * wait, self.explore_max)
        self.probing = False
