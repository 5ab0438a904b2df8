"""Per-model admission in front of the engines: a bounded number of requests
decode at once, the rest wait in a queue served round-robin across keys.

Engines keep their own FIFO queues; the gateway admits at most the model's
`max_concurrent` requests into them, so the order in which requests reach an
engine is decided here, fairly: one key's fifty waiting requests do not put
another key's single request behind all fifty. With K keys waiting, a newly
queued request is admitted after at most K - 1 others (one per other key),
plus those of its own key queued before it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class FairQueue(Generic[T]):
    """Waiting items, FIFO within a key, round-robin across keys.

    A key with items waits in the rotation; popping serves the key at the
    front and, if it has more, sends it to the back. A key that arrives
    joins at the back, behind every key already waiting."""

    def __init__(self) -> None:
        self._keys: OrderedDict[str, deque[T]] = OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, key: str, item: T) -> None:
        self._keys.setdefault(key, deque()).append(item)
        self._len += 1

    def pop(self) -> tuple[str, T] | None:
        if not self._keys:
            return None
        key, items = next(iter(self._keys.items()))
        item = items.popleft()
        if items:
            self._keys.move_to_end(key)
        else:
            del self._keys[key]
        self._len -= 1
        return key, item

    def remove(self, key: str, item: T) -> bool:
        items = self._keys.get(key)
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del self._keys[key]
        self._len -= 1
        return True

    def waiting(self, key: str) -> int:
        return len(self._keys.get(key, ()))


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


class GateClosed(Exception):
    """The server is shutting down: nobody else is admitted."""


class ModelGate:
    """`slots` requests decode at once; up to `max_queue` more wait, at most
    `max_wait` seconds each. Event loop only (no locks: nothing here awaits
    between reading and changing the counts)."""

    def __init__(self, slots: int, max_queue: int, max_wait: float):
        self.slots = slots
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.running = 0
        self.closed = False
        self._queue: FairQueue[asyncio.Future] = FairQueue()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def reserve(self, key: str) -> asyncio.Future | None:
        """A slot now (None), or a place in the queue to `wait` on; QueueFull
        when the queue is at its bound, GateClosed once closed. Synchronous,
        so a caller can count the request against its key's quota only once
        it is accepted."""
        if self.closed:
            raise GateClosed
        if self.running < self.slots and not self._queue:
            self.running += 1
            return None
        if len(self._queue) >= self.max_queue:
            raise QueueFull
        place = asyncio.get_running_loop().create_future()
        self._queue.push(key, place)
        return place

    async def wait(self, key: str, place: asyncio.Future) -> None:
        """Until `place` is given a slot; QueueTimeout after max_wait,
        GateClosed if the gate closes. If the waiter is cancelled (the client
        left) it leaves the queue."""
        try:
            # Not wait_for: on 3.11 it can swallow a cancel that races the grant.
            async with asyncio.timeout(self.max_wait):
                await asyncio.shield(place)
        except BaseException as e:
            if place.done() and not place.cancelled():
                if place.exception() is None:
                    self.release()  # the slot came as we gave up: pass it on
            else:
                place.cancel()
                self._queue.remove(key, place)
            if isinstance(e, TimeoutError):
                raise QueueTimeout from None
            raise

    def close(self) -> None:
        """Admit nobody from now on: every waiter gets GateClosed at once;
        requests holding a slot go on."""
        self.closed = True
        while (head := self._queue.pop()) is not None:
            if not head[1].done():
                head[1].set_exception(GateClosed())

    def release(self) -> None:
        """A slot holder finished: the slot goes to the next waiter in turn."""
        while (head := self._queue.pop()) is not None:
            place = head[1]
            if not place.done():
                place.set_result(None)
                return
        self.running -= 1
