"""Bounded workers for a request's CPU work, so the event loop does only I/O.

Tokenizing, chat templates, building and bounding grammars run here, not
on the loop: a 4 MB count_tokens took 3.6 s on it, and every other client
(even /v1/models) waited as long. Threads, not processes: the tokenizer's
Rust code lets the loop run beside it (a 4 MB encode on a thread held the
loop at most 0.15 s), and Jinja's Python yields the GIL every few
milliseconds. What could crash the process natively goes to a child instead
(grammar/sandbox.py).

The pool is bounded twice: `workers` threads, and `queue` jobs waiting
beyond them, past which a job is refused at once (EngineOverloaded: a 429
with Retry-After) rather than queued without end. A job whose request is
cancelled still runs to its end on its thread (a thread cannot be
interrupted): the size limits on what reaches it bound that.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from specgate.engines.base import EngineOverloaded

T = TypeVar("T")


class CPUPool:
    def __init__(self, workers: int, queue: int):
        self.workers, self.queue = workers, queue
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="specgate-cpu")
        self.pending = 0  # running or waiting (read on the loop only)
        self.refused = 0

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if self.pending >= self.workers + self.queue:
            self.refused += 1
            raise EngineOverloaded(f"{self.pending} requests are being tokenized or compiled; "
                                   "try again shortly")  # fmt: skip
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._executor, functools.partial(fn, *args, **kwargs)
            )
        finally:
            self.pending -= 1


# One per process, shared by every model: the cores are shared too. Two
# threads at least, so one long job never holds up the short ones alone.
POOL = CPUPool(workers=max(2, os.cpu_count() or 2), queue=256)


async def run_cpu(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the shared pool (see the module docstring)."""
    return await POOL.run(fn, *args, **kwargs)
