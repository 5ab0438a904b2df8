"""A watch on the event loop: when it stops answering, the log says where it is stuck.

The event loop only does I/O (engines' work runs on their threads, CPU work
in bounded workers); a loop that stops turning stops every stream's
keep-alives and every other client with it. A daemon thread posts a no-op
onto the loop every `period_s` and, when one has not run after `lag_s`,
logs one warning for the episode with the loop thread's stack and every
other thread's (a C call holding the GIL shows as the thread inside it),
then one line when the loop answers again, saying how long it was stuck.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

PERIOD_S = 0.5
LAG_S = 2.0


class LoopWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, period_s: float = PERIOD_S,
                 lag_s: float = LAG_S):  # fmt: skip
        self.loop, self.period_s, self.lag_s = loop, period_s, lag_s
        self.loop_thread = threading.get_ident()  # made on the loop's own thread
        self.stalls: list[float] = []  # each episode's length, seconds (for tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specgate-loop-watch", daemon=True)

    def start(self) -> LoopWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + self.lag_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            answered = threading.Event()
            sent = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop closed
                return
            if answered.wait(self.lag_s) or self._stop.is_set():
                continue
            log.warning("the event loop has not answered for %.1f s: every stream waits on it\n%s",
                        time.monotonic() - sent, self._stacks())  # fmt: skip
            while not answered.wait(self.period_s):
                if self._stop.is_set():
                    return
            stalled = time.monotonic() - sent
            self.stalls.append(stalled)
            log.warning("the event loop answered again after %.1f s", stalled)

    def _stacks(self) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        out = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this watch itself
            which = "event loop" if ident == self.loop_thread else names.get(ident, "?")
            out.append(f"-- thread {which} ({ident}):\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(out)
