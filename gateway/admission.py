"""Per-model admission in front of the engines: a bounded number of requests
decode at once, the rest wait in a queue fair across keys.

Engines keep their own FIFO queues; the gateway admits at most the model's
`max_concurrent` requests into them, so the order in which requests reach an
engine is decided here, fairly. A freed slot goes to the waiting key that has
held the model's slots least lately (slot-seconds, in flight included, with
a half-life of SERVICE_HALF_LIFE_S), FIFO within a key; keys tied (none has
held a slot lately) take turns round-robin. So one key's fifty waiting
requests do not put another key's single request behind all fifty, and a
key whose clients hang up after a second or two cannot take more of the
slots' time than any other key just by sending more, shorter requests:
counting admissions instead let one such key take 40 % of the time against
ten keys (bench/load.py's hostile mix).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

SERVICE_HALF_LIFE_S = 60.0


class ServiceClock:
    """Slot-seconds held per key: those of finished requests, decaying with a
    half-life, plus those of the key's requests holding a slot now."""

    def __init__(self, half_life_s: float = SERVICE_HALF_LIFE_S, clock=time.monotonic):
        self.rate = math.log(2) / half_life_s
        self.clock = clock
        self._done: dict[str, tuple[float, float]] = {}  # key -> (slot-seconds, as of)
        self._holding: dict[str, deque[float]] = {}  # key -> start times of its slots

    def start(self, key: str) -> None:
        self._holding.setdefault(key, deque()).append(self.clock())

    def stop(self, key: str) -> None:
        # The key's earliest start, whichever of its requests ended: the key's
        # total (done + holding) is the same either way.
        starts = self._holding.get(key)
        if not starts:
            return
        now = self.clock()
        held = now - starts.popleft()
        if not starts:
            del self._holding[key]
        self._done[key] = (self._decayed(key, now) + held, now)

    def _decayed(self, key: str, now: float) -> float:
        value, since = self._done.get(key, (0.0, now))
        return value * math.exp(-self.rate * (now - since))

    def of(self, key: str) -> float:
        now = self.clock()
        return self._decayed(key, now) + sum(now - t for t in self._holding.get(key, ()))


class FairQueue(Generic[T]):
    """Waiting items, FIFO within a key; across keys, the one with the least
    `service` first, ties in turn.

    A key with items waits in the rotation; popping serves the least-served
    key nearest the front and, if it has more, sends it to the back. A key
    that arrives joins at the back. With no service told (all zero) this is
    plain round-robin: a key arriving while K others wait is served after at
    most K items, however many those keys queued."""

    def __init__(self, service: Callable[[str], float] | None = None) -> None:
        self._keys: OrderedDict[str, deque[T]] = OrderedDict()
        self._len = 0
        self._service = service or (lambda key: 0.0)

    def __len__(self) -> int:
        return self._len

    def push(self, key: str, item: T) -> None:
        self._keys.setdefault(key, deque()).append(item)
        self._len += 1

    def pop(self) -> tuple[str, T] | None:
        if not self._keys:
            return None
        key = min(self._keys, key=self._service)  # the first of equals: rotation order
        items = self._keys[key]
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

    def longest(self) -> str | None:
        """The key with the most items waiting."""
        return max(self._keys, key=lambda k: len(self._keys[k]), default=None)

    def pop_newest(self, key: str) -> T:
        items = self._keys[key]
        item = items.pop()
        if not items:
            del self._keys[key]
        self._len -= 1
        return item


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

    def __init__(self, slots: int, max_queue: int, max_wait: float,
                 service: ServiceClock | None = None):  # fmt: skip
        self.slots = slots
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.running = 0
        self.closed = False
        self.service = service or ServiceClock()
        self._queue: FairQueue[asyncio.Future] = FairQueue(self.service.of)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def reserve(self, key: str) -> asyncio.Future | None:
        """A slot now (None), or a place in the queue to `wait` on; QueueFull
        when the queue is at its bound and `key` has its share of it (see
        _make_room), GateClosed once closed. Synchronous,
        so a caller can count the request against its key's quota only once
        it is accepted."""
        if self.closed:
            raise GateClosed
        if self.running < self.slots and not self._queue:
            self.running += 1
            self.service.start(key)
            return None
        if len(self._queue) >= self.max_queue:
            self._make_room(key)
        place = asyncio.get_running_loop().create_future()
        self._queue.push(key, place)
        return place

    async def wait(self, key: str, place: asyncio.Future) -> None:
        """Until `place` is given a slot; QueueTimeout after max_wait,
        GateClosed if the gate closes, QueueFull if the place is given to
        another key's request. If the waiter is cancelled (the client
        left) it leaves the queue."""
        try:
            # Not wait_for: on 3.11 it can swallow a cancel that races the grant.
            async with asyncio.timeout(self.max_wait):
                await asyncio.shield(place)
        except BaseException as e:
            if place.done() and not place.cancelled():
                if place.exception() is None:
                    self.release(key)  # the slot came as we gave up: pass it on
            else:
                place.cancel()
                self._queue.remove(key, place)
            if isinstance(e, TimeoutError):
                raise QueueTimeout from None
            raise

    def _make_room(self, key: str) -> None:
        """The queue is full: the newest waiter of the key with the most
        waiting gives its place up (QueueFull, a 429) when that key holds at
        least two more places than `key`; else QueueFull for `key`. So a key
        that retries at once after every 429 cannot fill the queue and keep
        the keys that wait their Retry-After out of it."""
        longest = self._queue.longest()
        if longest is None or self._queue.waiting(longest) < self._queue.waiting(key) + 2:
            raise QueueFull
        place = self._queue.pop_newest(longest)
        if not place.done():
            place.set_exception(QueueFull())

    def close(self) -> None:
        """Admit nobody from now on: every waiter gets GateClosed at once;
        requests holding a slot go on."""
        self.closed = True
        while (head := self._queue.pop()) is not None:
            if not head[1].done():
                head[1].set_exception(GateClosed())

    def release(self, key: str) -> None:
        """`key`'s slot holder finished: the slot goes to the next waiter in turn."""
        self.service.stop(key)
        while (head := self._queue.pop()) is not None:
            waiter, place = head
            if not place.done():
                self.service.start(waiter)
                place.set_result(None)
                return
        self.running -= 1
