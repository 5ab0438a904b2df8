"""One model's embedding and rerank work, on a worker thread of its own.

The event loop hands a request's inputs (already tokenized, each within the
model's context) to `Embedder.embed` or `Embedder.score` and awaits the
result; the worker runs them in forwards of at most `max_batch_tokens`
padded tokens, round-robin across the requests it holds, so a client with
2,000 inputs does not hold up one with a single query. Each forward takes
the model's lock (LoadedModel.lock), as the decoding engines' steps do: the
weights are shared, and a long decode and a batch of embeddings interleave
step by step. A request whose client leaves stops at its next forward.

The forward is the model's own trunk (the final norm's hidden states, no
KV cache, a causal mask): rows are padded on the right, so padding never
reaches a real token, and each row's vector equals its forward alone up
to float rounding.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from specgate.engines.base import EngineError, EngineOverloaded, EngineStopped
from specgate.engines.embedding.pooling import Pooling, finish, pool
from specgate.engines.embedding.rerank import Answers, score
from specgate.engines.loading import LoadedModel

log = logging.getLogger(__name__)

_STOP = object()  # in the inbox: the worker ends


def default_batch_tokens() -> int:
    """Padded tokens per forward: a CPU's forward of 2,048 takes about a
    second on a small model (the unit a cancel or another request waits
    for); a GPU's of 16,384 still fits in a fraction of its memory."""
    return 16384 if mx.default_device() == mx.gpu else 2048


@dataclass(eq=False)
class _Job:
    inputs: list[list[int]]
    kind: str  # "embed" | "score"
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    answers: Answers | None = None
    order: list[int] = field(default_factory=list)  # inputs by length, longest first
    next: int = 0  # into order: the first input not yet run
    results: dict[int, np.ndarray | float] = field(default_factory=dict)
    cancelled: bool = False

    def answer(self, value) -> None:
        def settle():
            if not self.done.done():
                if isinstance(value, BaseException):
                    self.done.set_exception(value)
                else:
                    self.done.set_result(value)

        self.loop.call_soon_threadsafe(settle)


class Embedder:
    def __init__(self, model_id: str, loaded: LoadedModel, pooling: Pooling, *,
                 max_batch_tokens: int | None = None, max_waiting: int = 64):  # fmt: skip
        self.model_id = model_id
        self.loaded = loaded
        self.pooling = pooling
        self.max_batch_tokens = max_batch_tokens or default_batch_tokens()
        self.max_waiting = max_waiting
        text = loaded.model.language_model if hasattr(loaded.model, "language_model") else loaded.model
        self._text = text
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._held = 0  # jobs submitted and not yet answered (event loop only)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.forwards = 0  # forwards run (the tests read it)

    # -- the event loop's side ----------------------------------------------------

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> np.ndarray:
        """(len(inputs), D) float32 vectors, pooled and normalized as the
        model does, cut to `dimensions` where given."""
        pooled = await self._run(_Job(inputs, "embed", *self._future()))
        return finish(np.stack(pooled).astype(np.float32), self.pooling.normalize, dimensions)

    async def score(self, inputs: list[list[int]], answers: Answers) -> list[float]:
        """P("yes") for each prompt (rerank.py's), at its last position."""
        return await self._run(_Job(inputs, "score", *self._future(), answers=answers))

    @staticmethod
    def _future() -> tuple[asyncio.AbstractEventLoop, asyncio.Future]:
        loop = asyncio.get_running_loop()
        return loop, loop.create_future()

    async def _run(self, job: _Job) -> list:
        if self._stopping:
            raise EngineStopped(f"model '{self.model_id}' was stopped")
        if self._held >= self.max_waiting:
            raise EngineOverloaded(f"model '{self.model_id}' holds {self._held} embedding "
                                   f"requests (limit {self.max_waiting})", retry_after=1.0)  # fmt: skip
        self._start()
        self._held += 1
        self._inbox.put(job)
        try:
            results = await asyncio.shield(job.done)
        except asyncio.CancelledError:
            job.cancelled = True  # the worker drops it before its next forward
            raise
        finally:
            self._held -= 1
        return [results[i] for i in range(len(job.inputs))]

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, daemon=True,
                                            name=f"embedder-{self.model_id}")  # fmt: skip
            self._thread.start()

    async def stop(self) -> None:
        """End every job it holds (EngineStopped) and its thread, after the
        forward in progress."""
        self._stopping = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(thread.join, 30.0)

    # -- the worker thread --------------------------------------------------------

    def _work(self) -> None:
        active: deque[_Job] = deque()  # the jobs held, in turn
        while True:
            try:
                arrived = self._inbox.get(block=not active)
            except queue.Empty:
                arrived = None  # nothing new: the next turn of those held
            if arrived is _STOP or self._stopping:
                break
            if arrived is not None:
                arrived.order = sorted(range(len(arrived.inputs)), key=lambda i: -len(arrived.inputs[i]))
                active.append(arrived)
            job = active.popleft()
            if job.cancelled:
                continue
            try:
                self._forward(job)
            except Exception as e:  # this request's failure, not the worker's
                log.exception("embedding forward failed for model %s", self.model_id)
                job.answer(EngineError(f"{type(e).__name__}: {e}"))
                continue
            if job.next < len(job.order):
                active.append(job)  # its next forward after the others'
            else:
                job.answer(job.results)
        stopped = EngineStopped(f"model '{self.model_id}' was stopped")
        for job in active:
            job.answer(stopped)
        while True:
            try:
                left = self._inbox.get_nowait()
            except queue.Empty:
                return
            if left is not _STOP:
                left.answer(stopped)

    def _take(self, job: _Job) -> list[int]:
        """The job's next inputs, longest first, as many as fit in one
        forward's padded budget (at least one)."""
        first = job.order[job.next]
        width = len(job.inputs[first])
        rows = max(1, self.max_batch_tokens // max(width, 1))
        taken = job.order[job.next: job.next + rows]
        job.next += len(taken)
        return taken

    def _forward(self, job: _Job) -> None:
        taken = self._take(job)
        lengths = [len(job.inputs[i]) for i in taken]
        width = max(lengths)
        ids = np.zeros((len(taken), width), dtype=np.int32)
        for row, i in enumerate(taken):
            ids[row, : lengths[row]] = job.inputs[i]
        with self.loaded.lock:
            hidden = self._text.model(mx.array(ids))
            if job.kind == "embed":
                out = mx.stack([hidden[row, n - 1] for row, n in enumerate(lengths)]) \
                    if self.pooling.mode == "last" else hidden
            else:
                last = mx.stack([hidden[row, n - 1] for row, n in enumerate(lengths)])
                out = self._logits(last)[:, [job.answers.yes, job.answers.no]]
            out = np.array(out.astype(mx.float32))
        self.forwards += 1
        if job.kind == "embed":
            vectors = out if self.pooling.mode == "last" else pool(out, lengths, self.pooling.mode)
            for row, i in enumerate(taken):
                job.results[i] = vectors[row]
        else:
            for row, i in enumerate(taken):
                job.results[i] = score(float(out[row, 0]), float(out[row, 1]))

    def _logits(self, hidden: mx.array) -> mx.array:
        text = self._text
        if getattr(text.args, "tie_word_embeddings", False) or not hasattr(text, "lm_head"):
            return text.model.embed_tokens.as_linear(hidden)
        return text.lm_head(hidden)
