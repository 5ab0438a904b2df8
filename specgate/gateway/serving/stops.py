"""Stop strings, matched on streamed text.

Text that might be the start of a stop string is held back until the next
piece of text says whether it was; text after a stop string is never sent.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Text that is safe to send now; sets `stopped` once a stop matched."""
        if not self.stops:
            return text
        buf = self._held + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self._held, self.stopped = "", True
            return buf[:cut]
        # Hold back the longest tail that is a prefix of some stop string.
        keep = 0
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation the held text is ordinary text."""
        held, self._held = self._held, ""
        return held
