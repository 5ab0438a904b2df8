"""The MTP engine: speculative decoding with a model's own MTP head.

Speculation serves one sequence at a time (batching is the other engine's
job: a policy sends concurrent load there). A worker thread owns the model
work; requests queue FIFO behind the one being decoded, and the planner is
asked for the depth at every round, so it can also switch speculation off
(depth 0) between rounds.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engines.base import (
    EngineError,
    EngineOverloaded,
    GenerationRequest,
    LiveState,
    Planner,
    RoundStats,
    TokenEvent,
)
from engines.loading import DEVICE_LOCK, LoadedModel
from engines.mlx_mtp.decoder import MTPDecoder, Step
from engines.mlx_mtp.loading import load_mtp_head
from engines.mlx_mtp.trunk import Trunk

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerationRequest
    planner: Planner
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: bool = False

    def post(self, *items: Any) -> None:
        self.loop.call_soon_threadsafe(_put_all, self.out, items)


def _put_all(out: asyncio.Queue, items) -> None:
    for item in items:
        out.put_nowait(item)


class MLXMTPEngine:
    name = "mlx_mtp"

    def __init__(
        self,
        model_id: str,
        loaded: LoadedModel,
        *,
        max_context: int,
        max_queue: int = 64,
        prefill_step_size: int = 512,
    ):
        self.model_id = model_id
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_context = max_context
        self.vocab_size = loaded.vocab_size
        self.max_queue = max_queue
        self.prefill_step_size = prefill_step_size
        self.trunk = Trunk(loaded.model)
        self.head = load_mtp_head(loaded)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0
        self._running = 0
        self._thread: threading.Thread | None = None

    # -- tokenizer (shared with every engine of this model) ---------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def render_chat(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._worker, name=f"mlx-mtp-{self.model_id}", daemon=True
            )
            self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop", None))
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def live_state(self) -> LiveState:
        return LiveState(self._running, max(0, self._in_flight - self._running), 0)

    # -- serving -------------------------------------------------------------------

    async def generate(
        self, request: GenerationRequest, planner: Planner
    ) -> AsyncIterator[TokenEvent | RoundStats]:
        if self._in_flight > self.max_queue:
            raise EngineOverloaded(
                f"model '{self.model_id}' (mtp) has {self._in_flight} requests in flight "
                f"(limit 1 decoding + {self.max_queue} queued)"
            )
        job = _Job(request, planner, asyncio.get_running_loop(), asyncio.Queue())
        self._in_flight += 1
        self._inbox.put(("submit", job))
        finished = False
        try:
            while True:
                item = await job.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineError(str(item)) from item
                if isinstance(item, TokenEvent) and item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._in_flight -= 1
            if not finished:
                job.cancelled = True  # the worker checks this between rounds

    # -- worker thread ---------------------------------------------------------------

    def _worker(self) -> None:
        waiting: deque[_Job] = deque()
        while True:
            block = not waiting
            try:
                command, job = self._inbox.get(timeout=None if block else 0)
            except queue.Empty:
                command = None
            if command == "stop":
                break
            if command == "submit":
                waiting.append(job)
                continue  # drain the inbox before starting work
            if waiting:
                self._serve(waiting.popleft(), waiting)
        for job in waiting:
            job.post(RuntimeError("engine stopped"))

    def _serve(self, job: _Job, waiting: deque[_Job]) -> None:
        if job.cancelled:
            return
        self._running = 1
        try:
            self._decode(job, waiting)
        except Exception as exc:
            log.exception("mlx_mtp failed on request %s", job.request.request_id)
            job.post(exc)
        finally:
            self._running = 0

    def _decode(self, job: _Job, waiting: deque[_Job]) -> None:
        request = job.request
        prefix = self.loaded.prefix_cache
        cache, rest = prefix.fetch(request.prompt_tokens)
        cached = len(request.prompt_tokens) - len(rest)
        decoder = MTPDecoder(self.trunk, self.head, request, cache, cached, self.tokenizer,
                             self.prefill_step_size)  # fmt: skip
        detok = self.tokenizer.detokenizer
        with DEVICE_LOCK:
            step = decoder.prefill()
        while True:
            job.post(*self._events(step, detok, cached))
            if step.finish_reason is not None:
                prefix.insert(decoder.tokens[:-1], decoder.cache)
                return
            self._take_submits(waiting)
            if job.cancelled:
                return
            plan = job.planner.plan(LiveState(1, len(waiting), len(decoder.tokens)))
            depth = plan.depth if plan.method == "mtp" else 0
            with DEVICE_LOCK:
                step = decoder.round(depth)

    def _take_submits(self, waiting: deque[_Job]) -> None:
        while True:
            try:
                command, job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "submit":
                waiting.append(job)
            else:  # "stop": finish this request first, then stop
                self._inbox.put((command, job))
                return

    @staticmethod
    def _events(step: Step, detok, cached: int) -> list:
        for t in step.tokens:
            detok.add_token(t)
        if step.finish_reason is not None:
            detok.finalize()
        event = TokenEvent(
            token_ids=step.tokens,
            text=detok.last_segment,
            finish_reason=step.finish_reason,
            logprobs=step.logprobs,
            cached_tokens=cached,
        )
        return [step.stats, event] if step.stats is not None else [event]


def head_nbytes(engine: MLXMTPEngine) -> int:
    """Bytes of the head's own parameters (the trunk's are shared)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(engine.head.parameters()))

