"""A watch on the event loop: when it stops answering, the log says where it is stuck.

The event loop only does I/O (engines' work runs on their threads, CPU work
in bounded workers); a loop that stops turning stops every stream's
keep-alives and every other client with it. A daemon thread posts a no-op
onto the loop every `period_s` and, when one has not run after `lag_s`,
logs one warning for the episode with the loop thread's stack and every
other thread's (a C call holding the GIL shows as the thread inside it),
then one line when the loop answers again, saying how long it was stuck.

A stall of the whole process stops the watch too: a C call that holds the
GIL, or a machine too busy to run it. The watch then sees its own wait
overrun, and says which one it was where the kernel says (Linux's
per-thread schedstat): time spent runnable but without a CPU is the
machine's load, not the gateway's.
"""

from __future__ import annotations

import asyncio
import logging
import os
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
        # (monotonic start, length, of which waiting for a CPU or None) of each
        # time the whole process, this watch included, was held up (for tests)
        self.pauses: list[tuple[float, float, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specgate-loop-watch", daemon=True)

    def start(self) -> LoopWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + self.lag_s + 1)

    def _run(self) -> None:
        while True:
            before, waited = time.monotonic(), _cpu_wait_s()
            if self._stop.wait(self.period_s):
                return
            if (late := time.monotonic() - before - self.period_s) > self.lag_s:
                self._paused(before + self.period_s, late, waited)
            answered = threading.Event()
            sent = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop closed
                return
            if answered.wait(self.lag_s):
                if (late := time.monotonic() - sent - self.lag_s) > 0:  # seen only now
                    self._paused(sent + self.lag_s, late, waited)
                continue
            if (late := time.monotonic() - sent - self.lag_s) > self.lag_s:
                # This watch woke late itself: the whole process was held (a
                # thread holding the GIL, a machine out of CPUs), the loop with
                # it. When the hold ends, this thread and the loop race for the
                # GIL; this one winning is no stall of the loop's own.
                self._paused(sent + self.lag_s, late, waited)
                if answered.wait(self.lag_s):
                    continue
            if self._stop.is_set():
                continue
            log.warning("the event loop has not answered for %.1f s: every stream waits on it\n%s",
                        time.monotonic() - sent, self._stacks())  # fmt: skip
            while not answered.wait(self.period_s):
                if self._stop.is_set():
                    return
            stalled = time.monotonic() - sent
            self.stalls.append(stalled)
            log.warning("the event loop answered again after %.1f s", stalled)

    def _paused(self, since: float, late: float, waited: float | None) -> None:
        """This watch woke `late` s after it should have: the process did not run."""
        cpu_wait = None if waited is None else _cpu_wait_s() - waited
        self.pauses.append((since, late, cpu_wait))
        log.warning("the whole process was held up for %.1f s (from monotonic %.3f), %s",
                    late, since, pause_cause(late, cpu_wait))  # fmt: skip

    def _stacks(self) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        out = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this watch itself
            which = "event loop" if ident == self.loop_thread else names.get(ident, "?")
            out.append(f"-- thread {which} ({ident}):\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(out)


def pause_cause(late: float, cpu_wait: float | None) -> str:
    """Why a pause of `late` s happened, given how much of it this thread
    spent runnable without a CPU."""
    if cpu_wait is None:
        return "the kernel does not say why"
    if cpu_wait > late / 2:
        return f"{cpu_wait:.1f} s of it waiting for a CPU: the machine is overloaded (load {_load()})"
    return (f"only {cpu_wait:.1f} s of it waiting for a CPU: a thread held the GIL "
            "(or the process was stopped)")


def _cpu_wait_s() -> float | None:
    """Seconds the calling thread has been runnable without a CPU (Linux's
    schedstat run_delay); None where the kernel does not say (macOS)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
