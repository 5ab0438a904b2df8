"""The shell every in-process MLX engine shares.

One worker thread per engine owns all MLX work for it; the event loop talks
to it only through a queue of commands, and the worker answers each request
through that request's asyncio queue, several answers per wake-up of the
loop. So MLX never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

import mlx.core as mx

from specgate.engines.base import (
    EngineError,
    EngineStopped,
    Handoff,
    HeldMemory,
    LiveState,
    MessageBoundaries,
    OutputConstraint,
    Refusal,
    SamplingParams,
    ThinkingFormat,
    TokenEvent,
)
from specgate.engines.cpu import run_cpu
from specgate.engines.embedding.embedder import Embedder
from specgate.engines.embedding.pooling import configured
from specgate.engines.grammar.sandbox import SANDBOX
from specgate.engines.loading import LoadedModel
from specgate.engines.settings import EmbeddingSettings, Task

log = logging.getLogger(__name__)


def default_prefill_step() -> int:
    """Prompt tokens per prefill chunk: mlx-lm's 2048 where MLX runs on a
    GPU (on an H200, 512-token chunks prefilled a 2048-token prompt at 0.78x
    mlx-lm's speed); 512 on a CPU, where a 2048-token chunk takes seconds
    and a cancelled request waits for its chunk to end."""
    return 2048 if mx.default_device() == mx.gpu else 512

# How long stop() waits for the worker to finish its current step (one prefill
# chunk or decoding step, seconds on a big model) before giving up on it.
STOP_JOIN_S = 30.0
STOP_POLL_S = 0.25
# The worker threads stop() gave up on. One stuck in MLX (a collective to a
# lost rank) holds MLX's locks, which its exit-time cleanup waits for: the
# process must then end without it (gateway/operator/cli.py).
ABANDONED: list[threading.Thread] = []


def deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    """Run on the event loop: hand each item to its request's queue."""
    for out, item in items:
        out.put_nowait(item)


def message_boundaries(tokenizer, messages: list[dict], tools: list[dict] | None,
                       tokens: list[int], template_kwargs: dict | None = None,
                       ) -> MessageBoundaries:  # fmt: skip
    """Each boundary is where the rendered prompt stops agreeing with a render
    of the messages before it followed by an empty user message: templates
    differ in what they write between messages (and some refuse a
    conversation with no user message), but the common prefix of two renders
    is always a prefix of the prompt, ending where the next message starts."""

    def agree(head: list[dict]) -> int:
        probe = [*head, {"role": "user", "content": ""}]
        try:
            other = tokenizer.apply_chat_template(probe, tools=tools or None,
                                                  add_generation_prompt=False,
                                                  **(template_kwargs or {}))  # fmt: skip
        except Exception:  # the template refused this shape: no boundary here
            return 0
        n = min(len(other), len(tokens))
        return next((i for i in range(n) if other[i] != tokens[i]), n)

    if messages and messages[0].get("role") == "system":
        system = agree(messages[:1])
    else:  # tools alone make a system block in most templates
        system = agree([]) if tools else 0
    history = agree(messages[:-1]) if len(messages) > 1 else 0
    return MessageBoundaries(system, history)


def _render_chat(tokenizer, messages: list[dict], tools: list[dict] | None,
                 template_kwargs: dict | None) -> list[int]:  # fmt: skip
    # mlx-lm's wrapper passes `enable_thinking` = whether the tokenizer has
    # thinking markers when the request leaves it unset (Qwen3.x's templates
    # think by default too), and renames it for renderers that call it
    # otherwise.
    return list(tokenizer.apply_chat_template(messages, tools=tools or None,
                                              add_generation_prompt=True,
                                              **(template_kwargs or {})))  # fmt: skip


def thinking_format(tokenizer, template: str | None) -> ThinkingFormat | None:
    """The model's thinking markers as mlx-lm's tokenizer wrapper found them
    (`_infer_thinking`), and whether its template has the switch. mlx-lm
    reads the vocabulary alone, and a family's non-thinking models share it
    (Qwen3-Coder's has `<think>`): a template that never writes the opening
    marker teaches no thinking (either marker: one of several tokens may be
    written in parts)."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    if template is not None and not (tokenizer.think_start in template
                                     or tokenizer.think_end in template):  # fmt: skip
        return None
    # A renderer of its own that takes the switch under another name is
    # handed it by mlx-lm's wrapper (apply_chat_template renames it).
    renamed = getattr(tokenizer, "_thinking_kwarg", "enable_thinking") != "enable_thinking"
    return ThinkingFormat(tokenizer.think_start, tokenizer.think_end,
                          tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens),
                          switchable=renamed or "enable_thinking" in (template or ""))  # fmt: skip


class WorkerEngine:
    name = "worker"

    def __init__(self, model_id: str, loaded: LoadedModel, *, max_context: int,
                 task: Task | None = None, embedding: EmbeddingSettings | None = None):  # fmt: skip
        """task: the model config's (None: embed for a checkpoint that
        declares its pooling, else generate); embedding: its settings."""
        self.model_id = model_id
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_context = max_context
        self.vocab_size = loaded.vocab_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0  # admitted, not yet finished (event loop only)
        self._running = 0  # producing tokens now (worker writes, others read)
        self._thread: threading.Thread | None = None
        # Set by stop(); the worker reads it between steps and ends every
        # request it holds with EngineStopped, the current one included.
        self._stopping = False
        # The queues of the requests being answered (event loop only), by id.
        self._outs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Their jobs, by the same id: the worker sets a job's `finished` when
        # it has decoded the request to its end (see live_state).
        self._jobs: dict[int, object] = {}
        if loaded.lockstep is not None:
            loaded.lockstep.when_broken(self._answer_all)
        self.task: Task = task or ("embed" if loaded.pooling is not None else "generate")
        self.embedding = embedding or EmbeddingSettings()
        self._embedder: Embedder | None = None

    def embedder(self) -> Embedder:
        """The model's embedding and rerank worker (engines/embedding/),
        started on first use, stopped with this engine."""
        if self._embedder is None:
            s = self.embedding
            pooling = configured(self.loaded.pooling, self.loaded.text_config, mode=s.pooling,
                                 normalize=s.normalize, matryoshka=s.matryoshka)  # fmt: skip
            self._embedder = Embedder(self.model_id, self.loaded, pooling,
                                      max_batch_tokens=s.max_batch_tokens)  # fmt: skip
        return self._embedder

    # -- the model's tokenizer ------------------------------------------------------

    # In-process, on the bounded CPU workers (engines/cpu.py), never on the
    # event loop: a request's text is as large as its body allows.
    async def encode(self, text: str) -> list[int]:
        return await run_cpu(self.tokenizer.encode, text)

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        return await run_cpu(_render_chat, self.tokenizer, messages, tools, template_kwargs)

    async def message_boundaries(
        self, messages: list[dict], tools: list[dict] | None, tokens: list[int],
        template_kwargs: dict | None = None,
    ) -> MessageBoundaries:
        return await run_cpu(message_boundaries, self.tokenizer, messages, tools, tokens,
                             template_kwargs)  # fmt: skip

    async def thinking_format(self) -> ThinkingFormat | None:
        return thinking_format(self.tokenizer, await self.chat_template())

    async def check_constraint(self, constraint: OutputConstraint) -> None:
        tokenizer = await run_cpu(self.loaded.grammars.spec)
        await SANDBOX.check(constraint.grammar, constraint.param, tokenizer)

    async def chat_template(self) -> str | None:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: transformers uses "tool_use" for tools
            template = template.get("tool_use") or template.get("default")
        return template if isinstance(template, str) else None

    def refusal(self, sampling: SamplingParams) -> Refusal | None:
        return None  # engines/sampling.py is this engine's own: every parameter applies

    def images_refused(self) -> str | None:
        if self.loaded.vision is not None:
            return None
        return self.loaded.images_refused or "it is a text model"

    async def prepare_images(self, tokens: list[int], images: list[bytes]):
        from specgate.engines.vision.images import prepare

        if (why := self.images_refused()) is not None:
            raise ValueError(why)
        # The context's room past the prompt and one token to generate.
        room = self.max_context - len(tokens) - 1
        return await run_cpu(prepare, self.loaded.vision, tokens, images, room)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            # The name is the same on every rank of a distributed model: rank
            # 0's turns name the thread (engines/distributed/lockstep.py).
            self._thread = threading.Thread(
                target=self._work, name=f"{self.name}-{self.model_id}", daemon=True
            )
            self._thread.start()

    async def stop(self, grace_s: float | None = None) -> None:
        """End every request in the engine (EngineStopped) and the worker,
        within one step of its work (a thread cannot be killed: the grace
        does not shorten the wait for that step)."""
        embedder, self._embedder = self._embedder, None
        if embedder is not None:
            await embedder.stop()
        if self._thread is not None:
            self._stopping = True
            self._inbox.put(("stop", None))
            thread, self._thread = self._thread, None
            lockstep = self.loaded.lockstep
            waited = 0.0
            while thread.is_alive() and waited < STOP_JOIN_S:
                await asyncio.to_thread(thread.join, STOP_POLL_S)
                waited += STOP_POLL_S
                if lockstep is not None and lockstep.problem is not None:
                    break  # a rank is gone: the thread may wait in a collective for good
            if thread.is_alive():
                ABANDONED.append(thread)
                log.error("%s of model %s did not stop within %g s", self.name,
                          self.model_id, waited)  # fmt: skip

    def _submitted(self) -> list:
        """The jobs submitted since the worker last looked. Other commands are
        dropped: a stop is already in `_stopping`, and callers take this only
        where cancels no longer matter (stopping) or never come (the
        speculative engine cancels by a flag on the job)."""
        jobs = []
        while True:
            try:
                command, job = self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if command == "submit":
                jobs.append(job)

    # -- a model over several ranks (engines/distributed/lockstep.py) ----------------------------

    def _share(self, decide, encode=None, decode=None):
        """A decision every rank of a distributed model takes from rank 0
        (`decode(encode(value))` on the others); just `decide()` otherwise."""
        lockstep = self.loaded.lockstep
        return decide() if lockstep is None else lockstep.share(decide, encode, decode)

    def _answer_all(self, problem: str) -> None:
        """The model's lockstep broke (any thread): every request being
        answered gets the reason now, from its event loop, whether or not
        this engine's thread is stuck in a collective to the lost rank."""
        for loop, out in self._outs.copy().values():  # (a copy is atomic; iterating is not)
            loop.call_soon_threadsafe(out.put_nowait, EngineError(problem))

    def stopped_error(self) -> EngineStopped:
        return EngineStopped(f"model '{self.model_id}' ({self.name}) was stopped")

    def problem(self) -> str | None:
        if self.loaded.lockstep is not None and self.loaded.lockstep.problem:
            return self.loaded.lockstep.problem
        if self._thread is not None and not self._thread.is_alive():
            return f"the {self.name} worker thread of model '{self.model_id}' has exited"
        return None

    def live_state(self) -> LiveState:
        """Requests decoding and queued here. One the worker has decoded to
        its end is neither, though the event loop, which may lag behind a
        busy worker, has not yet taken its last events: a stream left alone
        is then alone at its next round. (`finished` is read before
        `_running`, which the worker lowers first, so a request ending
        meanwhile is counted, never missed.)"""
        finished = sum(1 for job in self._jobs.copy().values() if job.finished)
        running = self._running
        return LiveState(running, max(0, self._in_flight - running - finished), 0, finished)

    def memory(self) -> list[HeldMemory]:
        from specgate.engines.memory import parameter_bytes

        # Every engine of this model shares these weights (engines/loading.py),
        # and its image side's tower (engines/vision/).
        held = [HeldMemory(f"mlx:{id(self.loaded.model)}", "weights",
                           parameter_bytes(self.loaded.model))]  # fmt: skip
        if (vision := self.loaded.vision) is not None:
            tower = sum(parameter_bytes(m) for m in vision.modules())
            held.append(HeldMemory(f"mlx:{id(vision)}", "weights", tower))
        return held

    def _worker(self) -> None:
        raise NotImplementedError

    def _work(self) -> None:
        from specgate.engines.distributed.lockstep import LockstepBroken

        try:
            self._worker()
        except LockstepBroken as e:
            if not self.loaded.lockstep.leader:  # rank 0 stopped, or a rank is gone
                log.info("%s of model %s ended: %s", self.name, self.model_id, e)
                return
            # Rank 0 without its other ranks: every request from now on gets
            # the reason (the engine had answered those it held).
            while not self._stopping:  # (the stop may be what found the rank gone)
                command, job = self._inbox.get()
                if command == "stop":
                    return
                if command == "submit":
                    job.post(EngineError(str(e)))

    # -- the async side of one request -----------------------------------------------

    async def _consume(
        self, job: object, out: asyncio.Queue, abandon: Callable[[], None]
    ) -> AsyncIterator:
        """Submit `job` to the worker once iteration starts (so a stream
        nobody reads never runs), then yield what the worker sends until the
        final TokenEvent; an exception from the worker becomes EngineError.
        If the consumer stops early (closed stream, client gone), `abandon`
        tells the worker."""
        lockstep = self.loaded.lockstep
        if lockstep is not None and lockstep.problem is not None:
            raise EngineError(lockstep.problem)  # (its thread may be stuck: refused here)
        self._outs[id(out)] = (asyncio.get_running_loop(), out)
        self._jobs[id(out)] = job
        self._inbox.put(("submit", job))
        self._in_flight += 1
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    if isinstance(item, EngineError):
                        raise item
                    raise EngineError(str(item)) from item
                if isinstance(item, Handoff) or (
                    isinstance(item, TokenEvent) and item.finish_reason is not None
                ):
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._in_flight -= 1
            del self._outs[id(out)], self._jobs[id(out)]
            if not finished:
                abandon()
