"""StopStringMatcher: finds stop strings in streamed text and says how much text is safe to send.

Text that could still be the beginning of a stop string is held back (its longest suffix that is a proper prefix of
some stop string), so a client never receives part of a stop string that then completes.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Stop strings of one request."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> int | None:
        """Index in ``text`` of the earliest stop string ending at or after ``new_from`` (the first character not
        searched before), or None."""
        if not self.stops:
            return None
        start = max(0, new_from - self._longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that could begin a stop string (send all but these)."""
        for size in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
