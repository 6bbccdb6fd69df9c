"""StopStringMatcher: find stop strings in streamed text without ever emitting part of one.

Text arrives in deltas whose boundaries fall anywhere, so a stop string can be split across several.
The matcher follows, for each stop string, the longest prefix of it that the text fed so far ends
with (a Knuth-Morris-Pratt automaton: each character costs amortized O(1) per stop). After each delta

  1. if some stop string is complete, the one that completes first wins (ties: the one that starts
     first, i.e. the longer): the text before it is emitted and everything from it on is dropped;
  2. otherwise it holds back the longest suffix of the text that is a proper prefix of some stop
     string (it could still become one) and emits the rest.

Invariant: the held-back text is always shorter than the longest stop string, and each feed costs
O(len(delta) * number of stops), whatever the stops and the text; SamplingParams bounds both
(MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS), since every feed runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from onecall.errors import InvalidParameterError


class StopStringMatcher:
    """Streams text through, cutting it at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidParameterError("stop", f"must be a list of non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self._failure = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: the longest prefix of it the text ends with
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the stream, once one has

    def feed(self, delta: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string matched by this delta or None)."""
        if self.matched is not None:
            return "", None  # already stopped: the rest of the stream is dropped
        buffer = self._held + delta
        base = len(self._held)

        # 1. advance every stop's automaton over the delta; note each one's first complete match
        best: tuple[int, int, str] | None = None  # (end, start, stop) in buffer positions
        for k, stop in enumerate(self.stops):
            state, failure, end = self._state[k], self._failure[k], len(stop)
            for j, ch in enumerate(delta):
                while state and stop[state] != ch:
                    state = failure[state - 1]
                if stop[state] == ch:
                    state += 1
                if state == end:
                    stop_end = base + j + 1
                    if best is None or (stop_end, stop_end - end) < best[:2]:
                        best = (stop_end, stop_end - end, stop)
                    break
            self._state[k] = state
        if best is not None:
            self._held, self.matched = "", best[2]
            return buffer[: best[1]], best[2]

        # 2. hold back the longest suffix that could still grow into a stop string
        num_held = max(self._state, default=0)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], None

    def flush(self) -> str:
        """End of generation without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held


def _failure(stop: str) -> list[int]:
    """KMP's table: failure[i] = the length of the longest proper prefix of stop[: i + 1] that is also
    a suffix of it."""
    failure = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        if stop[i] == stop[k]:
            k += 1
        failure[i] = k
    return failure
