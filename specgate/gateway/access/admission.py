"""Per-model admission in front of the engines: a bounded number of requests
decode at once, the rest wait in a queue fair across keys.

Engines keep their own FIFO queues; the gateway admits at most the model's
`max_concurrent` requests into them, so the order in which requests reach an
engine is decided here, fairly. A freed slot goes to the waiting key whose
requests had the fewest tokens processed lately (prompt and generated
tokens, with a half-life of WORK_HALF_LIFE_S), FIFO within a key; keys tied
(none has used the model lately) take turns round-robin. This is the
Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI 2024), with decay in place of its counter lift. So one key's
fifty waiting requests do not put another key's single request behind all
fifty, and a key whose clients send long prompts and hang up mid-prefill
cannot take more of the model's work than any other key: counting
admissions (or slot time) instead let one such key halve the throughput
of ten others (bench/load.py's hostile mix).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

WORK_HALF_LIFE_S = 60.0


class KeyWork:
    """Tokens processed per key (charged by the gateway as it admits a
    prompt and as tokens are generated), decaying with a half-life, so
    use long past is forgiven."""

    def __init__(self, half_life_s: float = WORK_HALF_LIFE_S, clock=time.monotonic):
        self.rate = math.log(2) / half_life_s
        self.clock = clock
        self._work: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of)

    def charge(self, key: str, tokens: float) -> None:
        now = self.clock()
        self._work[key] = (max(0.0, self._decayed(key, now) + tokens), now)

    def _decayed(self, key: str, now: float) -> float:
        tokens, since = self._work.get(key, (0.0, now))
        return tokens * math.exp(-self.rate * (now - since))

    def of(self, key: str) -> float:
        return self._decayed(key, self.clock())


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

    def __iter__(self) -> Iterator[tuple[str, T]]:
        """Every waiting (key, item); for reading only."""
        return ((key, item) for key, items in self._keys.items() for item in items)

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


@dataclass(eq=False)  # a place is itself, never equal to another
class Place:
    """A request's place in the queue: the future a slot is handed through,
    and who waits, since when (for the admin page's queue view)."""

    key: str
    request_id: str | None
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    since: float = field(default_factory=time.monotonic)


class ModelGate:
    """`slots` requests decode at once; up to `max_queue` more wait, at most
    `max_wait` seconds each. Event loop only (no locks: nothing here awaits
    between reading and changing the counts)."""

    def __init__(self, slots: int, max_queue: int, max_wait: float,
                 work: KeyWork | None = None):  # fmt: skip
        self.slots = slots
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.running = 0
        self.closed = False
        self.work = work or KeyWork()  # charged by the slot holders (gateway/serving/generation.py)
        self._queue: FairQueue[Place] = FairQueue(self.work.of)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def waiters(self, now: float | None = None) -> list[dict]:
        """Who waits for a slot now, longest first: key name, request id
        and seconds waited. A copy; the queue is not touched."""
        now = time.monotonic() if now is None else now
        places = sorted((place for _, place in self._queue), key=lambda p: p.since)
        return [{"key": p.key, "request_id": p.request_id, "waited_s": round(now - p.since, 1)}
                for p in places]  # fmt: skip

    def reserve(self, key: str, request_id: str | None = None) -> Place | None:
        """A slot now (None), or a place in the queue to `wait` on; QueueFull
        when the queue is at its bound and `key` has its share of it (see
        _make_room), GateClosed once closed. Synchronous,
        so a caller can count the request against its key's quota only once
        it is accepted."""
        if self.closed:
            raise GateClosed
        if self.running < self.slots and not self._queue:
            self.running += 1
            return None
        if len(self._queue) >= self.max_queue:
            self._make_room(key)
        place = Place(key, request_id)
        self._queue.push(key, place)
        return place

    async def wait(self, key: str, place: Place) -> None:
        """Until `place` is given a slot; QueueTimeout after max_wait,
        GateClosed if the gate closes, QueueFull if the place is given to
        another key's request. If the waiter is cancelled (the client
        left) it leaves the queue."""
        future = place.future
        try:
            # Not wait_for: on 3.11 it can swallow a cancel that races the grant.
            async with asyncio.timeout(self.max_wait):
                await asyncio.shield(future)
        except BaseException as e:
            if future.done() and not future.cancelled():
                if future.exception() is None:
                    self.release()  # the slot came as we gave up: pass it on
            else:
                future.cancel()
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
        place = self._queue.pop_newest(longest).future
        if not place.done():
            place.set_exception(QueueFull())

    def close(self) -> None:
        """Admit nobody from now on: every waiter gets GateClosed at once;
        requests holding a slot go on."""
        self.closed = True
        while (head := self._queue.pop()) is not None:
            if not head[1].future.done():
                head[1].future.set_exception(GateClosed())

    def release(self) -> None:
        """A slot holder finished: the slot goes to the next waiter in turn."""
        while (head := self._queue.pop()) is not None:
            place = head[1].future
            if not place.done():
                place.set_result(None)
                return
        self.running -= 1
