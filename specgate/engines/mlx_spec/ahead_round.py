"""One greedy MTP round of ahead.py as a function of device arrays, and the
same round compiled (`mx.compile`) so that a GPU replays it without Python.

Why compiled: a round is ~k+1 head forwards and a trunk verify forward;
building that graph in Python (~700 modules' calls for a 7B round) is a
large part of a round's host time, which ahead.py's queueing hides only
while the device is slower than the host. A compiled round is traced once
per shape and then replayed from C++, with its elementwise chains fused.

A round's shapes repeat: its depth k, the head's input pairs (the last
round's k+1), and the caches' buffers, which are whole and fixed in size
(kv_buffer.DeviceOffsetKV: rows written at an array offset, grown 256 rows
at a time). So a trace is kept per (k, pairs, buffer sizes, kernels on or
off) and each is replayed until a buffer grows. The buffers are grown on the
host before a call, for the most rows the round can write, so that inside
the trace nothing grows; the host then counts the rows written into each
cache's `bound`, as DeviceOffsetKV's own writes would.

Exactness: the compiled round computes the same graph as `round_graph`
(tests/test_ahead.py runs both against plain greedy decoding).

Built before it is used (`warm_first`, the engine's on a GPU): MLX builds a
compiled graph's fused kernels at its first evaluation, with NVRTC on CUDA,
one at a time in a process; a fresh H100's first MTP round waited ~70 s for
them. So a trace's first rounds run uncompiled (the same graph, from
Python), and from its BUILD_AT_CALL'th call a thread traces the same
function, compiled anew, on zeros of the round's shapes, on a stream of
its own, and evaluates it: MLX keeps a built module for the process by
its name, which its text decides, so the engine's own trace finds every
kernel built. The rounds are compiled from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import mlx.core as mx

from specgate.engines.forwards.kv_buffer import DeviceOffsetKV
from specgate.kernels import tiles

log = logging.getLogger(__name__)

@dataclass
class RoundOut:
    drafts: mx.array  # (k,)
    accepted: mx.array  # () int32: drafts that stand
    bonus: mx.array  # (1,) the target's token after them
    pairs: mx.array  # (1, k + 1) the head's next input tokens
    hidden: mx.array  # (1, k + 1, H) the trunk's at the verify rows


DraftsHook = Callable[..., mx.array]


def round_graph(target, head, k: int, pairs: mx.array, hidden: mx.array, standing: mx.array,
                last: mx.array, trunk: list, head_cache: list, hook: DraftsHook | None = None,
                hook_inputs: tuple = ()) -> RoundOut:  # fmt: skip
    """One round: the head's k drafts (the last round's pairs fed at once,
    the first `standing` of them stand, then its own chain, whose rows are
    dropped after), the verify forward over [last, d_1..d_k] and the greedy
    verdict; the caches keep what stands. `hook(drafts, *hook_inputs)`
    replaces the drafts on the device (a bench's oracle, bench/round_phases.py;
    the product has none)."""
    with target.verify_kernels():  # the pairs' rows, and the drafts' lm_head (a wide one-row product)
        out = head(target.embed(pairs), hidden, head_cache)
    head_cache[0].keep(standing)
    stays = head_cache[0].offset
    o = mx.take(out, standing - 1, axis=1)[:, None]
    drafts = []
    for j in range(k):
        with target.verify_kernels():
            logits = target.logits(o)
        d = mx.argmax(logits[0, -1], axis=-1, keepdims=True).astype(mx.int32)
        drafts.append(d)
        if j + 1 < k:
            o = head(target.embed(d[None]), o, head_cache, step=j + 1)
    head_cache[0].offset = stays
    drafts = mx.concatenate(drafts)
    if hook is not None:
        drafts = hook(drafts, *hook_inputs)
    rows = mx.concatenate([last, drafts])[None]
    with target.verify_kernels():
        forward = target.forward(rows, trunk, undo="tape")
        chosen = mx.argmax(target.logits(forward.hidden)[0], axis=-1).astype(mx.int32)
    accepted = mx.cumprod((drafts == chosen[:k]).astype(mx.int32)).sum()
    bonus = mx.take(chosen, accepted)[None]
    target.keep(trunk, forward, accepted + 1)
    # The next round's head pairs: (d_j, the trunk's hidden before it) for
    # the accepted drafts, then (bonus, the last accepted row's).
    pairs = mx.where(mx.arange(k + 1) < accepted, mx.concatenate([drafts, bonus]), bonus)[None]
    return RoundOut(drafts, accepted, bonus, pairs, forward.hidden)


def compilable(trunk: list, head_cache: list) -> bool:
    """Every cache a DeviceOffsetKV: a hybrid's recurrent layers are kept
    from a tape whose shape is the target's business, so they run uncompiled."""
    return all(type(c) is DeviceOffsetKV for c in (*trunk, *head_cache))


class CompiledRounds:
    """`round_graph` compiled, for one target and MTP head (one per engine:
    the traces serve every request). warm_first: a trace's kernels are built
    in the background before it is used (the module's docstring); meanwhile
    `__call__` returns None and the caller runs `round_graph`. warm_lock:
    held while the background thread traces (the engine's model lock: the
    trace calls the same modules its rounds do)."""

    def __init__(self, target, head, hook: DraftsHook | None = None, *, warm_first: bool = False,
                 warm_lock: AbstractContextManager | None = None):  # fmt: skip
        self.target, self.head, self.hook = target, head, hook
        self._compiled: dict[tuple, object] = {}
        self.built_first = BuiltFirst(warm_lock) if warm_first else None

    def _function(self, k: int, kernels: bool, n_trunk: int, n_hook: int, fresh: bool = False):
        """The compiled round for this key; `fresh`: a new compiled function
        (a warm-up's: its trace and stream apart from the engine's)."""
        key = (k, kernels, n_trunk, n_hook)
        if key not in self._compiled or fresh:
            target, head, hook = self.target, self.head, self.hook

            def one_round(pairs, hidden, standing, last, trunk_offset, head_offset, *inputs):
                hook_inputs, buffers = inputs[:n_hook], inputs[n_hook:]
                trunk = [_traced(*buffers[2 * i : 2 * i + 2], trunk_offset) for i in range(n_trunk)]
                heads = [_traced(*buffers[2 * i : 2 * i + 2], head_offset)
                         for i in range(n_trunk, len(buffers) // 2)]  # fmt: skip
                with tiles.stock():  # (a trace keeps its branch: never the way round a tile's build)
                    r = round_graph(target, head, k, pairs, hidden, standing, last, trunk, heads,
                                    hook, hook_inputs)  # fmt: skip
                return (r.drafts, r.accepted, r.bonus, r.pairs, r.hidden, trunk[0].offset,
                        heads[0].offset, *[a for c in (*trunk, *heads) for a in (c.keys, c.values)])  # fmt: skip

            if fresh:
                return mx.compile(one_round)
            self._compiled[key] = mx.compile(one_round)
        return self._compiled[key]

    def __call__(self, k: int, pairs: mx.array, hidden: mx.array, standing: mx.array,
                 last: mx.array, trunk: list, head_cache: list, hook_inputs: tuple = ()) -> RoundOut | None:  # fmt: skip
        """The round, compiled; None where its kernels are still being built
        (warm_first): the caller runs `round_graph`."""
        head_rows = make_room(trunk, head_cache, k, pairs.shape[1])
        key = (k, bool(self.target.kernels), len(trunk), len(hook_inputs))
        # One offset for the trunk's caches and one for the head's: each
        # group is written and kept alike, so their offsets are equal, and
        # one input each lets the trace merge every layer's identical offset
        # arithmetic (its rows, its keep) into one launch instead of one a layer.
        inputs = (pairs, hidden, standing, last, trunk[0].offset, head_cache[0].offset, *hook_inputs,
                  *buffers_of(trunk, head_cache))  # fmt: skip
        if self.built_first is not None and not self.built_first.ready(
                key, lambda: self._function(*key, fresh=True), inputs, ones=(2,)):  # (2: standing)
            return None
        drafts, accepted, bonus, pairs, hidden, trunk_offset, head_offset, *buffers = \
            self._function(*key)(*inputs)  # fmt: skip
        took_back(trunk, head_cache, buffers, trunk_offset, head_offset, k, head_rows)
        return RoundOut(drafts, accepted, bonus, pairs, hidden)


# A build's zeros stand for the caches' buffers (batch, heads, rows, head
# dim) with at most this many rows: a long context's first round would
# otherwise copy its whole cache for it (~0.5 GB per 4096 rows for a 7B).
# MLX passes sizes to its fused kernels as arguments, so fewer rows should
# build the same modules; where one differs, the round builds it in place.
BUILD_ROWS = 4096

# A shape's build starts at its third call: a round queued ahead is read
# after the next is queued, so by then its first uncompiled round has been
# evaluated, and what MLX built for that in this process (its gathers and
# scatters, one at a time as every NVRTC build here) did not wait behind
# the build's fused kernels.
BUILD_AT_CALL = 3


class BuiltFirst:
    """Which traces' kernels are built, and the threads building the others
    (the module's docstring: warm_first). `lock`: held while a thread traces."""

    def __init__(self, lock: AbstractContextManager | None = None):
        self._lock = lock or nullcontext()
        self._built: set[tuple] = set()  # (a failed build too: the trace then builds in place)
        self._threads: dict[tuple, threading.Thread] = {}
        self._calls: dict[tuple, int] = {}

    def ready(self, key: tuple, make: Callable[[], Callable], inputs: tuple, ones: tuple[int, ...] = ()) -> bool:
        """Whether `key`'s kernels are built; if not, from its BUILD_AT_CALL'th
        call a thread (one per key) builds them: `make()`, a compiled function of its own, called on
        zeros shaped as `inputs` (ones at the positions `ones`; a cache
        buffer's rows at most BUILD_ROWS) on a stream of its own, and
        evaluated."""
        if key in self._built:
            return True
        self._calls[key] = calls = self._calls.get(key, 0) + 1
        if calls >= BUILD_AT_CALL and key not in self._threads:
            shapes = [((*a.shape[:2], min(a.shape[2], BUILD_ROWS), *a.shape[3:]) if a.ndim == 4 else a.shape,
                       a.dtype) for a in inputs]  # fmt: skip
            self._threads[key] = threading.Thread(target=self._build, args=(key, make, shapes, ones),
                                                  daemon=True, name=f"round-build {key}")  # fmt: skip
            self._threads[key].start()
        return False

    def _build(self, key: tuple, make: Callable[[], Callable], shapes: list, ones: tuple[int, ...]) -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                dummies = [(mx.ones if i in ones else mx.zeros)(s, d) for i, (s, d) in enumerate(shapes)]
                with self._lock:  # (the trace runs the modules' Python)
                    outs = make()(*dummies)
                mx.eval(outs)
        except Exception as e:
            log.warning("compiled round %s: building its kernels first failed (%s: %s); its first "
                        "compiled round builds them", key, type(e).__name__, e)  # fmt: skip
        self._built.add(key)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every build started has ended, waiting up to `timeout` in all."""
        end = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._threads.values()):
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads.values())


def make_room(trunk: list, head_cache: list, k: int, pairs: int) -> int:
    """Before a compiled round at depth k fed `pairs` head pairs: every
    buffer grown for the most rows it can write (inside the trace nothing
    grows). Returns the head's rows: the pairs, then the chain's k - 1."""
    head_rows = pairs + k - 1
    for c in trunk:
        c.room(k + 1)
    for c in head_cache:
        c.room(head_rows)
    return head_rows


def buffers_of(trunk: list, head_cache: list) -> list[mx.array]:
    """The caches' buffers as a compiled round's inputs, in order."""
    return [a for c in (*trunk, *head_cache) for a in (c.keys, c.values)]


def took_back(trunk: list, head_cache: list, buffers: list, trunk_offset: mx.array,
              head_offset: mx.array, k: int, head_rows: int) -> None:  # fmt: skip
    """After a compiled round: the caches take its buffers and offsets, and
    the host counts the rows it wrote into each cache's bound."""
    for i, c in enumerate((*trunk, *head_cache)):
        c.keys, c.values = buffers[2 * i : 2 * i + 2]
        c.offset = trunk_offset if i < len(trunk) else head_offset
    for c in trunk:
        c.bound += k + 1
    for c in head_cache:
        c.bound += head_rows


def _traced(keys: mx.array, values: mx.array, offset: mx.array) -> DeviceOffsetKV:
    """A cache inside the trace: its buffers are the inputs, and grown
    already (bound 0: `room` never grows them here)."""
    return DeviceOffsetKV.of(keys, values, offset, bound=0)
