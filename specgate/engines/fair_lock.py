"""The lock a model's engines take around each step (engines/loading.py)."""

from __future__ import annotations

import threading
from collections import deque


class FairLock:
    """A mutex handed over in arrival order.

    threading.Lock lets the thread that just released it take it straight
    back, so an engine looping over prefill chunks would starve the other
    engine of its model; here a release hands the lock to the longest waiter.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: deque[threading.Lock] = deque()
        self._held = False

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        turn.acquire()  # released by the holder's release(): the lock is ours

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # stays held, by the next waiter
            else:
                self._held = False

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
