"""StopStringMatcher: find stop strings in streamed text without ever emitting part of one.

Text arrives in deltas whose boundaries fall anywhere, so a stop string can be split across several.
The matcher keeps a small buffer: after each delta it

  1. looks for a complete stop string in the buffer; the one that ends first (ties: the longer one)
     wins, the text before it is emitted and everything from it on is dropped;
  2. otherwise holds back the longest suffix of the buffer that is a proper prefix of some stop string
     (it could still become one) and emits the rest.

Invariant: the held-back text is always shorter than the longest stop string, so each feed costs
O((len(delta) + longest stop) * number of stops), however long the generation; SamplingParams bounds
both (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS), since every feed runs on the engine thread.
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
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the stream, once one has

    def feed(self, delta: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string matched by this delta or None)."""
        if self.matched is not None:
            return "", None  # already stopped: the rest of the stream is dropped
        buffer = self._held + delta

        # 1. a complete stop string: the one that completes first (the earliest end; ties: the earliest
        #    start), which is the one a token-by-token stream would have hit first, however it was split
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self._held, self.matched = "", best[2]
            return buffer[: best[1]], best[2]

        # 2. hold back the longest suffix that could still grow into a stop string
        num_held = _longest_open_suffix(buffer, self.stops)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], None

    def flush(self) -> str:
        """End of generation without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held


def _longest_open_suffix(buffer: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `buffer` that is a proper prefix of some stop string.
    For each stop, only the positions holding its first character are tried (str.find jumps to
    them), from the one farthest back that could still beat the best so far."""
    n = len(buffer)
    best = 0
    for stop in stops:
        first = stop[0]
        i = buffer.find(first, max(n - len(stop) + 1, 0), n - best)  # suffixes longer than `best`
        while i >= 0:
            if stop.startswith(buffer[i:]):
                best = n - i
                break
            i = buffer.find(first, i + 1, n - best)
    return best
