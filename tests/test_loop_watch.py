"""gateway/serving/loop_watch.py: an event loop that stops answering is reported with where it is stuck.

Failure injection (a fake): a callback on the loop sleeps (time.sleep) for
longer than the watch's lag; the watch logs one warning naming the event
loop thread's stack, inside that callback, then how long the loop was
stuck. A loop that only awaits is never reported.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from specgate.gateway.serving.loop_watch import LoopWatch, pause_cause


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


def _holds_the_gil(seconds: float) -> None:
    """The injected hold: a C call that keeps the GIL (the re module's
    backtracking on a pattern that never matches), longer each time until
    one lasts `seconds`."""
    import re

    n = 18
    while True:
        t0 = time.monotonic()
        re.fullmatch(r"(a+)+b", "a" * n)
        if time.monotonic() - t0 >= seconds:
            return
        n += 1


def test_a_thread_holding_the_gil_is_reported_as_a_pause_of_the_whole_process(caplog):
    """The watch cannot run either while another thread holds the GIL: it
    sees its own wait overrun and reports the pause, with how much of it
    its thread waited for a CPU where Linux tells (what that means is
    pause_cause's, below: on a loaded machine the wait can be either)."""

    async def main():
        watch = LoopWatch(asyncio.get_running_loop(), period_s=0.05, lag_s=0.3).start()
        await asyncio.sleep(0.3)
        quiet = list(watch.pauses)
        await asyncio.to_thread(_holds_the_gil, 0.8)  # the loop itself only awaits
        await asyncio.sleep(0.2)
        watch.stop()
        return quiet, watch.pauses

    with caplog.at_level(logging.WARNING, logger="specgate.gateway.serving.loop_watch"):
        quiet, pauses = asyncio.run(main())
    assert quiet == []
    assert pauses and max(late for _, late, _ in pauses) > 0.3, pauses
    assert "the whole process was held up for" in caplog.text
    if sys.platform == "linux":
        assert all(wait is not None for _, _, wait in pauses), pauses


def test_a_pause_is_the_machine_s_when_most_of_it_went_waiting_for_a_cpu():
    assert "the machine is overloaded" in pause_cause(10.0, 9.0)
    assert "a thread held the GIL" in pause_cause(10.0, 0.5)
    assert "does not say" in pause_cause(10.0, None)
