"""gateway/serving/loop_watch.py: an event loop that stops answering is reported with where it is stuck.

Failure injection (a fake): a callback on the loop sleeps (time.sleep) for
longer than the watch's lag; the watch logs one warning naming the event
loop thread's stack, inside that callback, then how long the loop was
stuck. A loop that only awaits is never reported.
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
