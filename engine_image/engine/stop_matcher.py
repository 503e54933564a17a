"""StopMatcher: stop strings found in text that arrives a piece at a time, in linear time.

For each stop string it keeps the length of the longest prefix of it that the text
ends with (the Knuth-Morris-Pratt automaton), advanced one character at a time: a
match is that length reaching the whole string, and the held-back tail (text that
may yet become a stop string, so must not go out) is the longest of those lengths.
Testing every tail of the text against every stop at each token cost time in the
stop's length per token: a 20,000-character stop made each token ~1.3 ms, on the
thread that steps every request of the engine.

The automaton's tables (`StopStrings`) are built once for a request's stop strings
and shared by its n choices: building them is linear in the strings' length, but
on the stepping thread, and n copies of long strings stalled every stream for
seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _failure(stop: str) -> tuple[int, ...]:
    """fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


@dataclass(frozen=True)
class StopStrings:
    """Stop strings with their failure tables: read-only, so choices can share it."""

    stops: tuple[str, ...]  # as the request gave them
    fails: tuple[tuple[int, ...], ...]  # _failure() of each stop, in order

    @classmethod
    def of(cls, stops: Sequence[str]) -> StopStrings:
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        return cls(tuple(stops), tuple(_failure(s) for s in stops))


class StopMatcher:
    def __init__(self, stops: StopStrings | Sequence[str]) -> None:
        table = stops if isinstance(stops, StopStrings) else StopStrings.of(stops)
        self._stops, self._fails = table.stops, table.fails
        # Per stop: how much of it the text ends with.
        self._matched = [0] * len(self._stops)
        self._length = 0  # characters fed so far

    def feed(self, piece: str) -> int | None:
        """Take the text's next characters; the start (in the whole text) of the first
        stop string they complete, else None. Of stops completing at one character,
        the longest (the earliest start) wins, as a search of the text would find."""
        stops, fails, matched = self._stops, self._fails, self._matched
        for c in piece:
            self._length += 1
            start = None
            for n, stop in enumerate(stops):
                k = matched[n]
                while k and stop[k] != c:
                    k = fails[n][k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):
                    begins = self._length - k
                    start = begins if start is None else min(start, begins)
                    k = fails[n][k - 1]
                matched[n] = k
            if start is not None:
                return start
        return None

    def held(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        return max(self._matched, default=0)
