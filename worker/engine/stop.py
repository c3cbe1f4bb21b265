"""Stop strings over streamed text (torch-free).

Text that could be the start of a stop string is held back until the next
piece decides it, so a stop string split across tokens is found and never
streamed, and nothing after it is returned.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.is_stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    def feed(self, text: str) -> str:
        """Add newly decoded text; returns what may be emitted now."""
        if self.is_stopped:
            return ""
        if not self._stops:
            return text
        pending = self._held + text
        found = [(i, s) for s in self._stops if (i := pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: (f[0], -len(f[1])))
            self.is_stopped, self._held = True, ""
            return pending[:cut]
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """At the end of generation the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
