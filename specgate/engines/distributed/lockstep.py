"""One model over several processes (a model's `distributed:` config), kept
in lockstep through MLX's own collectives.

Every rank loads its shard of the model (`shard_model`: mlx-lm's `shard()`
for tensor parallelism, `pipeline()` for layers split in order) and builds
the same engines. Rank 0 serves HTTP and makes every decision that is not
a function of the model's numbers: which request an engine takes next,
whether its client left, the plan for the next round. The other ranks run
the same engine code on the same requests and, at each of those points,
receive rank 0's decision instead of making one (`Lockstep.share`). So
every rank runs the same forwards in the same order with the same shapes,
which is what the collectives inside a sharded model need.

The order is the model's lock. On rank 0 every collective happens under it
(forwards did already; a shared decision takes it), and taking it sends
whose turn it is: the name of the engine thread that took it. On the other
ranks a conductor thread (`follow`) reads those turns and hands the lock to
that engine's thread, which runs the same section, receiving decisions
where rank 0 sent them, then hands the lock back on release.

An idle rank waits for rank 0's next turn in a plain socket read
(engines/distributed/doorbell.py), not in MLX's receive, which polls.

A rank that is gone makes the next collective raise on the others, and
rank 0's doorbell watcher finds it sooner, or a rank that is stuck, without
waiting for one; the lockstep is then broken for good (`problem`), and the
model's engines fail their requests with that reason, from the event loop
if their thread is stuck in a collective (`when_broken`).
"""

from __future__ import annotations

import logging
import pickle
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from specgate.engines.base import GenerationRequest, Handoff
from specgate.engines.distributed.doorbell import answer_doorbell, leader_host, open_doorbell
from specgate.engines.fair_lock import FairLock

log = logging.getLogger(__name__)

T = TypeVar("T")
STOP = ("stop",)  # rank 0 stopping: every other rank ends its conductor


@dataclass(frozen=True)
class Distribution:
    """How a model is spread: `mode` "tensor" (every layer split across the
    ranks) or "pipeline" (the layers split in order); the group is
    mx.distributed's, as `mlx.launch` set it up."""

    mode: str
    group: Any  # mx.distributed.Group
    rank_timeout_s: float = 15.0  # engines/distributed/doorbell.py's watcher

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def shard_model(model, distribution: Distribution) -> None:
    """Split a lazily loaded mlx-lm model across the group, before its
    weights are evaluated (each rank then reads only its part)."""
    group, mode = distribution.group, distribution.mode
    if mode == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"mlx-lm's {type(model).__module__} has no shard(): "
                             "use distributed.mode: pipeline, if it has pipeline()")  # fmt: skip
        model.shard(group)
        return
    text = model.language_model if hasattr(model, "language_model") else model
    if not hasattr(text.model, "pipeline"):
        raise ValueError(f"mlx-lm's {type(model).__module__} has no pipeline(): "
                         "use distributed.mode: tensor, if it has shard()")  # fmt: skip
    text.model.pipeline(group)


class Channel:
    """Python objects from rank 0 to every rank, passed down the ring
    (rank r receives from r-1 and sends on to r+1: the ring backend sends
    between neighbours). Point-to-point, not a collective: on the ring a
    small all_sum or all_gather takes milliseconds, a send tens of
    microseconds (bench/distributed.py). A message is a fixed-size head
    (its length, and the bytes when they fit), for a longer one the rest,
    then the last rank's acknowledgement to rank 0. Rank 0 is trusted (the ranks are one program, started together
    by mlx.launch), so the bytes are a pickle."""

    HEAD = 1024  # bytes: 8 of length, the rest payload

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def _pass(self, data: mx.array | None, like: mx.array) -> mx.array:
        """Receive from the previous rank (unless rank 0), send to the next (unless last)."""
        if self.rank > 0:
            data = mx.distributed.recv_like(like, self.rank - 1, group=self.group, stream=mx.cpu)
            mx.eval(data)
        if self.rank < self.size - 1:
            mx.eval(mx.distributed.send(data, self.rank + 1, group=self.group, stream=mx.cpu))
        return data

    def _ack(self) -> None:
        """The last rank tells rank 0 (its ring neighbour) the message went
        round. Rank 0 learns of a rank that is gone here: waiting for a
        receive from a closed socket fails, a send into one may not."""
        ack = mx.zeros((1,), dtype=mx.uint8)
        if self.rank == 0:
            mx.eval(mx.distributed.recv_like(ack, self.size - 1, group=self.group, stream=mx.cpu))
        elif self.rank == self.size - 1:
            mx.eval(mx.distributed.send(ack, 0, group=self.group, stream=mx.cpu))

    def send(self, obj: object) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = np.zeros(self.HEAD, dtype=np.uint8)
        head[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        first = payload[: self.HEAD - 8]
        head[8 : 8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
        self._pass(mx.array(head), mx.array(head))
        rest = payload[self.HEAD - 8 :]
        if rest:
            data = mx.array(np.frombuffer(rest, dtype=np.uint8))
            self._pass(data, data)
        self._ack()

    def receive(self) -> object:
        head = bytes(np.array(self._pass(None, mx.zeros((self.HEAD,), dtype=mx.uint8))))
        size = int.from_bytes(head[:8], "little")
        payload = head[8 : 8 + min(size, self.HEAD - 8)]
        if size > self.HEAD - 8:
            rest = self._pass(None, mx.zeros((size - (self.HEAD - 8),), dtype=mx.uint8))
            payload += bytes(np.array(rest))
        self._ack()
        return pickle.loads(payload)


class Lockstep:
    """The model's lock and shared decisions, for a model over several
    ranks (engines use it where a single-process model has a FairLock)."""

    def __init__(self, group, rank_timeout_s: float = 15.0):
        self.channel = Channel(group)
        self.rank = group.rank()
        self.rank_timeout_s = rank_timeout_s  # rank 0: a rank silent this long is lost
        self.problem: str | None = None  # why the lockstep broke (a rank is gone)
        self._when_broken: list[Callable[[str], None]] = []
        self._order = FairLock()  # rank 0: mutual exclusion among its threads
        self._holder: int | None = None  # the thread holding the lock
        self._depth = 0
        self._by_turn = False  # other ranks: held as a turn the conductor handed over
        # Other ranks: the thread whose turn it is, handed over by `follow`.
        self._turn = threading.Condition()
        self._turn_of: str | None = None
        # Handoffs between the model's engines on other ranks, by request id
        # (engines/mlx_spec/engine.py and mlx_plain: a follower engine posts
        # them here, the engine resuming the request takes them).
        self._handoffs: dict[str, Any] = {}
        self._handed = threading.Condition()
        self.active = False  # rank 0: sections are turns (begin())
        self._following = False  # other ranks: the conductor runs (follow())
        self._deciding: set[int] = set()  # other ranks: threads inside share()
        self._ended = False  # other ranks: rank 0 stopped
        self._doorbell = None  # rank 0: rings the other ranks before each turn (begin())
        self._bell = None  # other ranks: where the conductor waits for a ring (follow())

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def begin(self) -> None:
        """Rank 0, once the model's engines are built and started: from now
        on every section of the lock is a turn the other ranks follow. (Before,
        as while loading, each rank's sections are its own.) First the other
        ranks' doorbells: this waits for them to finish loading and follow."""
        if self.channel.size > 1:
            with self._order:
                self._doorbell = open_doorbell(lambda offer: self._send(("doorbell", offer)),
                                               self.channel.size - 1, leader_host())  # fmt: skip
            self._doorbell.watch(self.rank_timeout_s, self._lost)
        self.active = True

    def _turns(self, me: int) -> bool:
        """Other ranks: whether this thread's section waits for its turn:
        while the conductor runs, and for a decision at any time."""
        return self._following or me in self._deciding

    # -- the lock --------------------------------------------------------------------

    def acquire(self) -> None:
        me = threading.get_ident()
        if self._holder == me:
            self._depth += 1
            return
        if self.leader or not self._turns(me):
            self._order.acquire()
            self._holder, self._depth, self._by_turn = me, 1, False
            if self.leader and self.active:
                try:
                    self._send(("turn", threading.current_thread().name), ring=True)
                except BaseException:
                    self._holder, self._depth = None, 0
                    self._order.release()
                    raise
            return
        name = threading.current_thread().name
        with self._turn:
            while self._turn_of != name:
                if self.problem is not None or self._ended:
                    raise LockstepBroken(self.problem or "rank 0 stopped")
                self._turn.wait(1.0)
        self._holder, self._depth, self._by_turn = me, 1, True

    def release(self) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self._by_turn or (self.leader and self.active):
            # What the section launched finishes inside it: mlx-lm evaluates
            # a batch step's tokens asynchronously, and collectives still in
            # flight would interleave with the next section's on the wire.
            mx.synchronize(generation_stream)
            mx.synchronize()
        self._holder = None
        if not self._by_turn:
            self._order.release()
            return
        with self._turn:
            self._turn_of = None
            self._turn.notify_all()

    def __enter__(self) -> Lockstep:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- decisions -------------------------------------------------------------------

    def share(self, decide: Callable[[], T], encode: Callable[[T], Any] | None = None,
              decode: Callable[[Any], T] | None = None) -> T:  # fmt: skip
        """Rank 0: `decide()` (outside the lock: it may wait for a request),
        then send it (as `encode` makes it) to every rank. Other ranks:
        receive it (`decode`d) without calling `decide`. Each call site must
        run the same on every rank, which it does when everything before it
        was shared."""
        if self.leader:
            value = decide()
            with self:
                self._send(("value", value if encode is None else encode(value)))
            return value
        me = threading.get_ident()
        self._deciding.add(me)
        try:
            with self:
                kind, value = self._receive()
        finally:
            self._deciding.discard(me)
        if kind != "value":
            self._broke(RuntimeError(f"lockstep lost its order: expected a decision, got {kind}"))
        return value if decode is None else decode(value)

    def _send(self, message: tuple, ring: bool = False) -> None:
        """ring: a message the other ranks' conductors wait for (a turn, the stop)."""
        if self.problem is not None:
            raise LockstepBroken(self.problem)
        if ring and self._doorbell is not None:
            self._doorbell.ring()
        try:
            self.channel.send(message)
        except RuntimeError as e:
            self._broke(e)

    def _receive(self) -> tuple:
        if self.problem is not None:
            raise LockstepBroken(self.problem)
        try:
            return self.channel.receive()
        except RuntimeError as e:
            self._broke(e)

    def _broke(self, error: BaseException):
        self._fail(str(error))
        raise LockstepBroken(self.problem) from error

    def _lost(self, why: str) -> None:
        """Rank 0's doorbell watcher: a rank's connection closed, or it went silent."""
        if self.active and self.problem is None:  # (not while stopping: ranks then leave)
            self._fail(why)

    def _fail(self, why: str) -> None:
        if self.problem is not None:
            return
        self.problem = (f"a rank of this distributed model is gone ({why}); "
                        "restart specgate under mlx.launch")  # fmt: skip
        log.error("%s", self.problem)
        for waiting in (self._turn, self._handed):
            with waiting:
                waiting.notify_all()
        for callback in self._when_broken:
            callback(self.problem)

    # -- handoffs between a model's engines, on the other ranks --------------------

    def hand_over(self, request_id: str, handoff: Any) -> None:
        """A follower engine handed `request_id` over, as rank 0's did."""
        with self._handed:
            self._handoffs[request_id] = handoff
            self._handed.notify_all()

    def take_handoff(self, request_id: str) -> Any:
        """The handoff the engine resuming `request_id` starts from. The two
        engines' threads run apart between turns: rank 0's command to resume
        can reach this rank before the engine handing over, behind on a busy
        machine, has posted it, so this waits for it (a rank silent this
        long would be lost too)."""
        with self._handed:
            if not self._handed.wait_for(lambda: request_id in self._handoffs or self.problem,
                                         self.rank_timeout_s):  # fmt: skip
                self._broke(RuntimeError(f"rank {self.rank}: the handoff of {request_id} never came"))
            if request_id not in self._handoffs:
                raise LockstepBroken(self.problem)
            return self._handoffs.pop(request_id)

    def when_broken(self, callback: Callable[[str], None]) -> None:
        """callback(problem), on whichever thread finds the lockstep broken (at
        once if it is): an engine answers its requests from the event loop,
        in case its own thread is stuck in a collective to the lost rank."""
        self._when_broken.append(callback)
        if self.problem is not None:
            callback(self.problem)

    def check(self, error: Exception) -> Exception:
        """A step failed: if a collective did (a rank is gone), the lockstep
        is broken, and what the request gets is that reason; else `error`."""
        if (isinstance(error, RuntimeError) and self.problem is None
                and re.search(r"\[(ring|jaccl|mpi)\]", str(error))):  # fmt: skip
            try:
                self._broke(error)
            except LockstepBroken:
                pass
        return LockstepBroken(self.problem) if self.problem is not None else error

    def stop(self) -> None:
        """Rank 0, once the model's engines stopped: tell every other rank
        to end (its conductor returns)."""
        if not (self.leader and self.active):
            return
        if self.problem is None:  # (else nobody listens, and an engine may hold the lock, stuck)
            with self._order:
                self.active = False
                try:
                    self._send(STOP, ring=True)
                except (RuntimeError, LockstepBroken):
                    pass
        self.active = False
        if self._doorbell is not None:
            self._doorbell.close()

    # -- other ranks -----------------------------------------------------------------

    def follow(self, alive: Callable[[str], bool]) -> None:
        """Other ranks: hand the lock to each thread rank 0 names, in rank
        0's order, until rank 0 stops (or is gone: then raises).
        alive(name): whether that engine thread still runs."""
        self._following = True
        kind, offer = self._receive()
        if kind != "doorbell":
            self._broke(RuntimeError(f"lockstep lost its order: expected the doorbell, got {kind}"))
        self._bell = answer_doorbell(offer, self.rank)
        try:
            self._conduct(alive)
        finally:
            if self._bell is not None:
                self._bell.close()

    def _conduct(self, alive: Callable[[str], bool]) -> None:
        while True:
            if self._bell is not None and not self._bell.wait():
                self._broke(ConnectionError("rank 0 closed its connection"))
            message = self._receive()
            if message == STOP:
                self._ended = True  # the engine threads waiting for a turn end
                with self._turn:
                    self._turn.notify_all()
                return
            kind, name = message
            if kind != "turn":
                self._broke(RuntimeError(f"lockstep lost its order: expected a turn, got {kind}"))
            with self._turn:
                self._turn_of = name
                self._turn.notify_all()
                while self._turn_of is not None:
                    if not alive(name):
                        self._broke(RuntimeError(f"engine thread {name} ended on rank {self.rank}"))
                    self._turn.wait(1.0)


def pin_seed(request: GenerationRequest) -> GenerationRequest:
    """Sampling without a seed draws from each process's own random state,
    which differs between ranks: rank 0 gives such a request a seed, which
    every rank then uses (a random seed: the same distribution). It then
    samples as a seeded request does (engines/sampling.py)."""
    s = request.sampling
    if s.greedy or s.seed is not None:
        return request
    return replace(request, sampling=replace(s, seed=secrets.randbits(63)))


SHARED_PLANS = object()  # another rank's stand-in for a request's planner: rank 0 plans


class Immediate:
    """A follower's stand-in for a request's event loop: it runs the
    callback at once, on the engine's thread."""

    @staticmethod
    def call_soon_threadsafe(callback, *args) -> None:
        callback(*args)


class FollowerOut:
    """Where an engine on another rank sends a request's events: nowhere
    (rank 0 answers the client), but a Handoff is kept for the engine that
    resumes the request, which rank 0 names next."""

    def __init__(self, request_id: str, lockstep: Lockstep):
        self.request_id, self.lockstep = request_id, lockstep

    def put_nowait(self, item: object) -> None:
        if isinstance(item, Handoff):
            self.lockstep.hand_over(self.request_id, item)


class LockstepBroken(RuntimeError):
    """A rank of a distributed model is gone; nothing on it can run."""
