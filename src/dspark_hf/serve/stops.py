"""Stop strings over a growing reply, in time linear in the text: each new character is read once per stop string.

The handler appends each round's text and asks two things: did a stop string complete (where does the earliest
one start), and how many characters at the end might still be the start of one (those are held back from a
stream until the next round decides). Both come from one Knuth-Morris-Pratt automaton per stop string, whose
state is exactly "the longest prefix of the stop string that the text ends with". Rescanning the text, or
testing every prefix of every stop string against its end, costs time quadratic in the stop string's length
per round, on the event loop.
"""

from __future__ import annotations


def _failure(pattern: str) -> list[int]:
    """KMP's failure function: `f[i]` is the length of the longest proper prefix of `pattern[: i + 1]` that is
    also its suffix."""
    f = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = f[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """Where the earliest of `stops` first occurs in a text fed to it piece by piece.

    Args:
        stops (`list[str]`): non-empty stop strings.

    Example: `m = StopMatcher(["ab"]); m.feed("xa")` returns `None` with `m.pending == 1` (the `"a"` may start
    `"ab"`); `m.feed("b")` then returns 1, where `"ab"` starts in the text fed so far.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.seen = 0  # characters fed so far
        self.pending = 0  # characters at the end of the text that may be the start of a stop string

    def feed(self, new: str) -> int | None:
        """Read `new` (the text's next characters); returns the start (in the whole text) of the earliest stop
        string that completes in it, or `None`. After a match the matcher is spent: feed it nothing more."""
        base, first = self.seen, None
        for i, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            k = self._state[i]
            for j, ch in enumerate(new):
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    start = base + j + 1 - len(stop)
                    first = start if first is None else min(first, start)
                    k = fail[k - 1]
                    break
            self._state[i] = k
        self.seen += len(new)
        self.pending = 0 if first is not None else max(self._state, default=0)
        return first
