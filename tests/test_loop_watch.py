"""gateway/serving/loop_watch.py: an event loop that stops answering is reported with where it is stuck.

Failure injections (fakes): a callback on the loop sleeps (time.sleep)
for longer than the watch's lag; the watch logs one warning naming the
event loop thread's stack, inside that callback, then how long the loop
was stuck. A loop that only awaits is never reported. Another thread
holding the GIL in one long C call stops the loop and the watch's thread
alike; the faulthandler timer the loop re-arms fires from C and names it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from specgate.gateway.serving.loop_watch import LoopWatch


def _stuck_in_a_blocking_call():
    time.sleep(1.2)  # the injected block: a sync call on the loop


def test_a_blocked_loop_is_reported_with_its_stack(caplog):
    async def main():
        watch = LoopWatch(asyncio.get_running_loop(), period_s=0.05, lag_s=0.3).start()
        await asyncio.sleep(0.5)  # awaiting: the loop answers
        quiet = list(watch.stalls)
        _stuck_in_a_blocking_call()
        await asyncio.sleep(0.4)
        watch.stop()
        return quiet, watch.stalls

    with caplog.at_level(logging.WARNING, logger="specgate.gateway.serving.loop_watch"):
        quiet, stalls = asyncio.run(main())
    assert quiet == []
    assert len(stalls) == 1 and 0.9 < stalls[0] < 2.0, stalls
    text = caplog.text
    assert "the event loop has not answered for" in text
    assert "-- thread event loop" in text and "_stuck_in_a_blocking_call" in text
    assert "the event loop answered again after" in text


def _holds_the_gil(n: int) -> int:
    return sum(range(n))  # one C call: no bytecode boundary, so the GIL is never handed over


def test_a_thread_holding_the_gil_is_caught_by_the_c_level_watch(capfd):
    """Failure injection: another thread holds the GIL in one long C call,
    so neither the loop nor the watch's own thread can run Python; the
    faulthandler timer the loop re-arms fires from C and names it."""
    import threading

    n = 10_000_000
    t0 = time.perf_counter()
    _holds_the_gil(n)
    per = time.perf_counter() - t0
    n = int(n * 1.5 / max(per, 1e-3))  # about 1.5 s of holding

    async def main():
        watch = LoopWatch(asyncio.get_running_loop(), period_s=0.05, lag_s=0.4).start()
        await asyncio.sleep(0.2)
        hog = threading.Thread(target=_holds_the_gil, args=(n,))
        hog.start()
        await asyncio.sleep(0.1)
        while hog.is_alive():
            await asyncio.sleep(0.05)
        watch.stop()

    asyncio.run(main())
    err = capfd.readouterr().err
    assert "Timeout (" in err, err[-2000:]
    assert "_holds_the_gil" in err, err[-3000:]
