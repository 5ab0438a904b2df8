"""The shell of every in-process speculative engine: MTP, DFlash, DSpark,
Gemma-4 assistants, n-gram copies and mtp+ngram (engines/drafting/).

A worker thread owns the model work, and the planner is asked for the
depth at every round, so it can also switch speculation off (depth 0)
between rounds, or move the request to another engine (a handoff: the
policy sends concurrent load to the plain engine's batch unless measured
costs say otherwise). Requests that reach this engine while one decodes
join it in one batch (mlx_spec/batch_decoder.py: one verify forward for
all, each at its own depth), one prefill chunk of the next per round,
up to MAX_BATCH; a hybrid's or a split model's requests queue FIFO
instead. One class serves every method: it is built with
the method's `Drafting` (engines/drafting/: the loaded drafter or head,
and how to make one sequence's proposer), loaded with the engine's own
settings (engines/settings.py: the depth it plans, a method's options), and
each request's decoder
(engines/mlx_spec/decoder.py) joins the model's target (engines/targets/) and
a fresh proposer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from specgate.engines import kernel_wiring
from specgate.engines.base import (
    EngineError,
    EngineOverloaded,
    GenerationRequest,
    Handoff,
    HeldMemory,
    LiveState,
    Method,
    Plan,
    Planner,
    PrefillProgress,
    RoundStats,
    TokenEvent,
)
from specgate.engines.cache.prefix_cache import Hit, snapshot
from specgate.engines.distributed.lockstep import FollowerOut, Immediate, LockstepBroken, pin_seed
from specgate.engines.drafting.base import Drafting
from specgate.engines.grammar.thinking import decoding_state
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.ahead import AheadDecoder
from specgate.engines.mlx_spec.ahead_round import CompiledRounds
from specgate.engines.mlx_spec.batch_ahead import CompiledBatchRounds
from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder, unbatchable
from specgate.engines.mlx_spec.decoder import SpecDecoder, Step
from specgate.engines.mlx_spec.kernel_proofs import KernelSwitch
from specgate.engines.settings import DraftSettings
from specgate.engines.targets import Target, target_for
from specgate.engines.worker import STOP_JOIN_S, WorkerEngine, default_prefill_step, deliver

log = logging.getLogger(__name__)

DEFAULT_VERIFY_DEPTH = 2  # a drafter without a cap, given no depth (MTPSettings' default)


@dataclass
class _Job:
    request: GenerationRequest
    planner: Planner
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    resume: Handoff | None = None
    cancelled: bool = False
    finished: bool = False  # decoded to its end (WorkerEngine.live_state)

    def post(self, *items: Any) -> None:
        self.loop.call_soon_threadsafe(deliver, [(self.out, item) for item in items])


# Requests decoded together at most (mlx_spec/batch_decoder.py): on an H100 a
# batch's verify forward through the kernels stays under 16 rows up to 8
# streams at depth 1 (docs/DESIGN.md, BatchSpecDecoder).
MAX_BATCH = 8


@dataclass
class _Stream:
    """A request past its prefill: its decoder and what its events need."""

    job: _Job
    decoder: SpecDecoder
    detok: Any
    cached: int

    @property
    def key(self) -> str:
        return self.job.request.request_id


class _Joining:
    """A request's prefill, one chunk per `advance` (the model's lock taken
    per chunk, a snapshot kept at the prefix cache's points), then its first
    token: `done`, with `stream` and `step`."""

    def __init__(self, engine: SpecEngine, job: _Job):
        self.engine, self.job = engine, job
        request, resume = job.request, job.resume
        prefix = engine.loaded.prefix_cache
        cache_id = engine.drafting.cache_id
        hit = (Hit(resume.cache, 0) if resume
               else prefix.fetch(request.cache_key(request.prompt_tokens), request.cache_scope,
                                 cache_id))  # fmt: skip
        self.cached = hit.cached
        decoder = engine.make_decoder(request, hit.cache, self.cached)
        if hit.drafter is not None:
            decoder.proposer.restore(hit.drafter)
        detok = resume.detokenizer if resume else engine.tokenizer.detokenizer
        self.stream = _Stream(job, decoder, detok, self.cached)
        self.step: Step | None = None
        self.fed, self.total = self.cached, len(request.prompt_tokens)
        if not resume:  # the lookup's outcome, before the first chunk (PrefillProgress)
            job.post(PrefillProgress(self.cached, self.total, self.cached))
        self.points = [] if resume else prefix.snapshot_points(request, self.cached)
        self._chunks = None if resume else decoder.prefill_chunks(self.points)

    @property
    def done(self) -> bool:
        return self.step is not None

    def advance(self) -> None:
        engine, decoder, request = self.engine, self.stream.decoder, self.job.request
        with engine.loaded.lock:
            if self._chunks is None:  # a handoff: its caches hold the sequence
                self.step = decoder.resume(self.job.resume)
                return
            if self.fed < self.total:
                self.fed = next(self._chunks)
            else:
                self.step = decoder.first_token()
                return
        if self.fed < self.total:
            self.job.post(PrefillProgress(self.fed, self.total, self.cached))
        if self.fed in self.points:
            prefix = engine.loaded.prefix_cache
            prefix.insert(request.cache_key(request.prompt_tokens[: self.fed]), snapshot(decoder.cache),
                          prefix.snapshot_scope(request, self.fed), drafter=engine.drafting.cache_id,
                          drafter_state=engine._drafter_state(decoder))  # fmt: skip

    def log_stop(self) -> None:
        # A long prompt nobody waits for must not hold the model (or, through
        # its lock, its plain engine) for minutes: it stops within a chunk.
        log.info("%s %s: request %s stopped after prefilling %d of %d prompt tokens",
                 self.engine.model_id, self.engine.name, self.job.request.request_id, self.fed,
                 self.total)  # fmt: skip


class SpecEngine(WorkerEngine):
    max_batch = MAX_BATCH  # registry.max_batch: the policy prices no wider batch

    def __init__(
        self,
        model_id: str,
        loaded: LoadedModel,
        *,
        name: str,
        drafting: Callable[[LoadedModel, Target, str | None, DraftSettings], Drafting],
        settings: DraftSettings | None = None,
        drafter: str | None = None,
        max_context: int,
        max_queue: int = 64,
        prefill_step_size: int | None = None,
        kernels: str = "auto",
        kernel_guard=None,
    ):
        """drafting(loaded, target, drafter, settings): the method's loader
        (e.g. specgate.engines.drafting.mtp.proposer.drafting); it raises
        ValueError, saying why, when this checkpoint (or `drafter` directory)
        cannot draft. settings: the engine's own (engines/settings.py, as the
        config validated them; None: the defaults); its `depth` is the
        deepest round the policy plans (capped by the drafter's max_drafts;
        None: max_drafts, else DEFAULT_VERIFY_DEPTH), and verify widths up to
        it + 1 are proved at load."""
        settings = DraftSettings() if settings is None else settings
        super().__init__(model_id, loaded, max_context=max_context)
        self.name = name
        self.max_queue = max_queue
        self.prefill_step_size = prefill_step_size or default_prefill_step()
        self.target = target_for(loaded.model)
        self.drafting = drafting(loaded, self.target, drafter, settings)
        self.method: Method = self.drafting.method
        # On CUDA, MLX's prompt tiles at the drafter's own shapes (the MTP
        # head's prefill runs every prompt row through it), built side by
        # side as loading builds the target's; no prompt waits for them.
        for module in {id(m): m for m in (self.drafting.kernel_module, self.drafting.weights)
                       if isinstance(m, nn.Module)}.values():  # fmt: skip
            kernel_wiring.prebuild_forward(module)
        self.max_drafts = self.drafting.max_drafts
        self.kernels_setting = kernels
        # Greedy MTP rounds queued one ahead (mlx_spec/ahead.py) where a GPU
        # runs them: there the host's work per round is the cost it hides.
        self.ahead = mx.default_device() == mx.gpu
        # ... each round compiled once per shape and replayed (ahead_round.py)
        self.compiled_rounds = self.ahead
        self._rounds: CompiledRounds | None = None
        # ... as are a batch's, where every stream fits (mlx_spec/batch_ahead.py)
        self._batch_rounds: CompiledBatchRounds | None = None
        self.batch_decoder = BatchSpecDecoder  # (a test counts its rounds through a subclass)
        self.kernel_guard = kernel_guard  # None: specgate.engines.kernel_wiring.shared_guard()
        self.kernel_switch: KernelSwitch | None = None  # set by wire_kernels
        self._batchable: bool | None = None  # decided at the first batch (_batches)
        depth = settings.depth or self.max_drafts or DEFAULT_VERIFY_DEPTH
        self.wire_kernels(depth if self.max_drafts is None else min(depth, self.max_drafts))

    def wire_kernels(self, max_depth: int) -> None:
        """Small-M kernels for this engine's verify forwards (kernels/wiring.py):
        the hook on a quantized trunk unless `kernels: off`, every verify
        width 2..max_depth+1 proved before a round uses it. Verdicts recorded
        for this machine wire them now; missing ones are proved in the
        background (engines/mlx_spec/kernel_proofs.py) while the engine
        serves on the stock verify path; then the widths only a batch of
        streams verifies (up to MAX_BATCH streams at any depth to
        max_depth), up to the hook's 16 rows."""
        self.kernel_switch = KernelSwitch(f"{self.model_id} {self.name}", self.loaded,
                                          self.target, self.kernels_setting,
                                          range(2, max_depth + 2), self.kernel_guard,
                                          self.drafting.kernel_module,
                                          [(streams, rows) for streams in range(2, MAX_BATCH + 1)
                                           for rows in range(1, max_depth + 2)])  # fmt: skip
        self.kernel_switch.start()

    @property
    def kernel_wiring(self):
        """What kernels/wiring.py decided (None while proving)."""
        return self.kernel_switch.wiring if self.kernel_switch else None

    @property
    def kernels_proving(self) -> bool:
        """Its verify kernels are being proved: verify is stock until they are
        (the policy plans plain decoding for this method meanwhile)."""
        return self.kernel_switch is not None and self.kernel_switch.proving

    def kernels_ready(self, timeout: float | None = None) -> bool:
        """Waits until the verify path is decided (kernels or stock)."""
        return self.kernel_switch is None or self.kernel_switch.wait(timeout)

    async def stop(self, grace_s: float | None = None) -> None:
        if self.kernel_switch is not None:  # the proof running ends, no other starts
            await asyncio.to_thread(self.kernel_switch.stop, STOP_JOIN_S)
        # A compiled round's build in flight (ahead_round.BuiltFirst) is one
        # MLX evaluation: waited for, bounded, so that no thread of this engine
        # runs MLX work as a process exits (STOP_JOIN_S for both together).
        end = time.monotonic() + STOP_JOIN_S
        for rounds in (self._rounds, self._batch_rounds):
            if rounds is not None and rounds.built_first is not None:
                await asyncio.to_thread(rounds.built_first.wait, max(0.0, end - time.monotonic()))
        await super().stop(grace_s)

    def memory(self) -> list[HeldMemory]:
        from specgate.engines.memory import parameter_bytes

        held = super().memory()
        if (module := self.drafting.weights) is not None:  # a head or a drafter
            held.append(HeldMemory(f"mlx:{id(module)}", "drafter", parameter_bytes(module)))
        return held

    def make_decoder(
        self, request: GenerationRequest, cache: list | None, cached_tokens: int
    ) -> SpecDecoder:
        grammar = decoding_state(self.loaded.grammars, request.sampling)
        proposer = self.drafting.proposer(self.target)
        args = (self.target, proposer, request, cache, cached_tokens, self.tokenizer,
                self.prefill_step_size)  # fmt: skip
        vision = self.loaded.vision
        if not (self.ahead and AheadDecoder.fits(self.target, proposer, request, grammar)):
            return SpecDecoder(*args, grammar=grammar, vision=vision)
        if self.compiled_rounds and self._rounds is None:  # the engine's head: one for every request
            # (its kernels built in the background: a GPU's first round
            # would wait for MLX's in-process builds; ahead_round.py)
            self._rounds = CompiledRounds(self.target, proposer.head, warm_first=True,
                                          warm_lock=self.loaded.lock)  # fmt: skip
        return AheadDecoder(*args, grammar=grammar, vision=vision,
                            rounds=self._rounds if self.compiled_rounds else None)  # fmt: skip

    def generate(
        self, request: GenerationRequest, planner: Planner, resume: Handoff | None = None
    ) -> AsyncIterator[TokenEvent | RoundStats | Handoff | PrefillProgress]:
        if self._in_flight > self.max_queue:
            raise EngineOverloaded(
                f"model '{self.model_id}' ({self.method}) has {self._in_flight} requests in flight "
                f"(limit 1 decoding + {self.max_queue} queued)"
            )
        job = _Job(request, planner, asyncio.get_running_loop(), asyncio.Queue(), resume)

        def abandon() -> None:
            job.cancelled = True  # the worker checks this between rounds

        return self._consume(job, job.out, abandon)

    # -- worker thread ---------------------------------------------------------------

    def _worker(self) -> None:
        waiting: deque[_Job] = deque()
        try:
            while True:
                command, job = self._share(lambda: self._next_command(block=not waiting),
                                           self._describe, self._follow)  # fmt: skip
                if command == "stop":
                    break
                if command == "submit":
                    waiting.append(job)
                    continue  # drain the inbox before starting work
                if waiting:
                    self._serve(waiting.popleft(), waiting)
        except LockstepBroken as e:  # a distributed model lost a rank: nothing runs
            for job in [*waiting, *self._submitted()]:
                job.post(EngineError(str(e)))
            raise
        waiting.extend(self._submitted())  # submitted after the stop
        for job in waiting:
            job.post(self.stopped_error())

    def _next_command(self, block: bool) -> tuple[str | None, _Job | None]:
        if self._stopping:
            return "stop", None
        try:
            command, job = self._inbox.get(timeout=None if block else 0)
        except queue.Empty:
            return None, None
        if command == "submit":
            self._taken(job)
        return command, job

    def _taken(self, job: _Job) -> None:
        if self.loaded.lockstep is not None:  # every rank must draw the same tokens
            job.request = pin_seed(job.request)

    # A command as it travels to the other ranks of a distributed model, and
    # the job it makes there (engines/distributed/lockstep.py).
    @staticmethod
    def _describe(command: tuple[str | None, _Job | None]) -> tuple:
        name, job = command
        if job is None:
            return name, None
        return name, (job.request, job.resume is not None)

    def _follow(self, described: tuple) -> tuple[str | None, _Job | None]:
        name, job = described
        if job is None:
            return name, None
        request, resumed = job
        lockstep = self.loaded.lockstep
        resume = lockstep.take_handoff(request.request_id) if resumed else None
        # No planner there: rank 0's plans are shared.
        return name, _Job(request, None, Immediate(), FollowerOut(request.request_id, lockstep),
                          resume)  # fmt: skip

    def _between_rounds(self, job: _Job, waiting: deque[_Job], decoder: SpecDecoder) -> tuple:
        """What the next round hangs on, decided at once (one message for a
        distributed model): the jobs submitted since, whether this one is
        gone ("stopping", "left" or None), and else the plan."""
        jobs = self._submitted()
        for new in jobs:
            self._taken(new)
        why = self._why_gone(job)
        live = LiveState(1, len(waiting) + len(jobs), len(decoder.tokens))
        return jobs, why, None if why else job.planner.plan(live)

    def _share_between_rounds(self, job: _Job, waiting: deque[_Job], decoder: SpecDecoder) -> tuple:
        return self._share(
            lambda: self._between_rounds(job, waiting, decoder),
            lambda d: ([self._describe(("submit", j))[1] for j in d[0]], *d[1:]),
            lambda d: ([self._follow(("submit", j))[1] for j in d[0]], *d[1:]))

    def _serve(self, job: _Job, waiting: deque[_Job]) -> None:
        if self._share(lambda: job.cancelled):
            return
        self._running = 1
        try:
            self._decode(job, waiting)
        except Exception as exc:
            log.exception("%s failed on request %s", self.name, job.request.request_id)
            if self.loaded.lockstep is not None:
                exc = self.loaded.lockstep.check(exc)
            job.post(exc)
        finally:
            self._running = 0

    def _gone(self, job: _Job) -> bool:
        """Checked between steps: the client left, or the engine is stopping
        (then the request ends with EngineStopped)."""
        return self._ended(job, self._share(lambda: self._why_gone(job)))

    def _why_gone(self, job: _Job) -> str | None:
        return "stopping" if self._stopping else "left" if job.cancelled else None

    def _ended(self, job: _Job, why: str | None) -> bool:
        if why == "stopping":
            job.post(self.stopped_error())
        return why is not None

    def _decode(self, job: _Job, waiting: deque[_Job]) -> None:
        """One request from its prefill to its end, alone, or in a batch
        with the requests that come while it decodes (where this engine
        batches: `_batches`), alone again when the others are gone."""
        stream = self._start(job)
        while stream is not None:
            stream = self._solo(stream, waiting)
            if stream is not None:  # requests wait: decode together
                stream = self._batched(stream, waiting)

    def _start(self, job: _Job) -> _Stream | None:
        """The request prefilled and its first token posted (None: it
        ended there, finished, left or stopped)."""
        joining = _Joining(self, job)
        while not joining.done:
            if self._gone(job):
                joining.log_stop()
                return None
            joining.advance()
        return self._first(joining)

    def _first(self, joining: _Joining) -> _Stream | None:
        stream, step = joining.stream, joining.step
        if self._ends(stream, step):
            return None
        stream.job.post(*self._events(step, stream.detok, stream.cached))
        return stream

    def _ends(self, stream: _Stream, step: Step) -> bool:
        """A step that ends the request: its last events posted, its caches
        kept for the prefix cache."""
        if step.finish_reason is None:
            return False
        job, decoder = stream.job, stream.decoder
        # Not running any more before the client can hear so: its next
        # request must not find this one still counted as in flight.
        self._running = max(0, self._running - 1)
        job.finished = True  # (after: see WorkerEngine.live_state)
        job.post(*self._events(step, stream.detok, stream.cached))
        self.loaded.prefix_cache.insert(job.request.cache_key(decoder.tokens[:-1]), decoder.cache,
                                        job.request.cache_scope,
                                        drafter=self.drafting.cache_id,
                                        drafter_state=self._drafter_state(decoder))  # fmt: skip
        return True

    def _solo(self, stream: _Stream, waiting: deque[_Job]) -> _Stream | None:
        """Rounds of one request until it ends (None), or, where this engine
        batches and other requests wait, its stream for `_batched`."""
        job, decoder = stream.job, stream.decoder
        while True:
            jobs, why, plan = self._share_between_rounds(job, waiting, decoder)
            waiting.extend(jobs)
            if self._ended(job, why):
                return None
            if plan.engine != self.name:  # e.g. batching: another request arrived
                self._hand_off(stream, plan)
                return None
            if waiting and self.batches_speculation():
                return stream
            depth = plan.depth if plan.method == self.method else 0
            with self.loaded.lock:
                step = decoder.round(depth)
            if self._ends(stream, step):
                return None
            job.post(*self._events(step, stream.detok, stream.cached))

    def _hand_off(self, stream: _Stream, plan: Plan) -> None:
        handoff = stream.decoder.handoff(plan, stream.detok)
        self._running = max(0, self._running - 1)
        stream.job.post(handoff)

    # -- several requests at once ---------------------------------------------------------

    def batches_speculation(self) -> bool:
        """Whether requests that come while one decodes join it in one
        batch (mlx_spec/batch_decoder.py) rather than wait their turn: where
        the batch takes its caches (KV caches, a hybrid's recurrent state;
        not Gemma-4's rotating windows, nor a quantized KV cache) and the
        model is not split across ranks. The policy prices batched rounds
        only for such an engine (registry.batches)."""
        if self._batchable is None:
            self._batchable = self.loaded.lockstep is None and unbatchable(self.target) is None
        return self._batchable

    def _batch_rounds_for(self, head) -> CompiledBatchRounds | None:
        """The engine's compiled batched rounds for its MTP head (one for
        every batch: their traces are kept), where rounds are compiled."""
        if self.compiled_rounds and self._batch_rounds is None:
            self._batch_rounds = CompiledBatchRounds(self.target, head, warm_first=True,
                                                     warm_lock=self.loaded.lock)  # fmt: skip
        return self._batch_rounds if self.compiled_rounds else None

    def _batched(self, first: _Stream, waiting: deque[_Job]) -> _Stream | None:
        """Requests decoded together: each round, one prefill chunk of the
        next waiting request (while the batch has room), then every
        stream's planner asked (a stream planned elsewhere leaves it, handed
        off), then one round for all at their planned depths. Returns the
        stream left alone when no other is in or waiting (None: none is)."""
        batch = self.batch_decoder(self.target, lambda: self.kernel_switch.rows if self.kernel_switch else 0,
                                   ahead=self.ahead, rounds=self._batch_rounds_for)  # fmt: skip
        streams: dict[str, _Stream] = {}
        joining: _Joining | None = None

        def join(stream: _Stream) -> None:
            stream.decoder.to_batch()
            with self.loaded.lock:
                batch.join(stream.key, stream.decoder)
            streams[stream.key] = stream

        def leave(key: str) -> _Stream:
            stream = streams.pop(key)
            with self.loaded.lock:
                stream.decoder = batch.leave(key)
            return stream

        self._running = 1
        join(first)  # (raising, the request is told by _serve)
        try:
            while streams or joining is not None:
                waiting.extend(self._taken_all(self._submitted()))
                if self._stopping:
                    for stream in [*streams.values(), *([joining.stream] if joining else [])]:
                        stream.job.post(self.stopped_error())
                    return None
                if joining is None and waiting and len(streams) < MAX_BATCH:
                    job = waiting.popleft()
                    if not job.cancelled:
                        self._running += 1
                        joining = self._guarded(job, partial(_Joining, self, job))[1]
                if joining is not None:
                    if joining.job.cancelled:
                        joining.log_stop()
                        joining, self._running = None, self._running - 1
                    elif not self._guarded(joining.job, joining.advance)[0]:
                        joining = None  # it failed: told so, the batch goes on
                    elif joining.done:
                        if (stream := self._first(joining)) is not None:
                            join(stream)
                        joining = None
                if not streams:
                    continue
                if len(streams) == 1 and joining is None and not waiting:
                    return leave(next(iter(streams)))
                depths = {}
                for key, stream in list(streams.items()):
                    if stream.job.cancelled:
                        leave(key)
                        self._running -= 1
                        continue
                    live = LiveState(len(streams), len(waiting), len(stream.decoder.tokens))
                    plan = stream.job.planner.plan(live)
                    if plan.engine != self.name:
                        self._hand_off(leave(key), plan)
                        continue
                    depths[key] = plan.depth if plan.method == self.method else 0
                if not streams:
                    continue
                with self.loaded.lock:
                    steps = batch.round(depths)
                for key, step in steps.items():
                    stream = streams[key]
                    if step.stats is not None:
                        step.stats.batch = len(steps)
                    if step.finish_reason is not None:
                        self._ends(leave(key), step)
                    else:
                        stream.job.post(*self._events(step, stream.detok, stream.cached))
        except Exception as exc:  # every request in the batch is told; none is left waiting
            log.exception("%s failed on a batch of %d requests", self.name, len(streams))
            for stream in [*streams.values(), *([joining.stream] if joining else [])]:
                stream.job.post(exc)
        return None

    def _guarded(self, job: _Job, work: Callable[[], Any]) -> tuple[bool, Any]:
        """A joining request's own work (its prefill, its first token):
        (True, what it returns), or (False, None) where it raised, the
        request told why and the batch going on without it."""
        try:
            return True, work()
        except Exception as exc:
            log.exception("%s failed on request %s", self.name, job.request.request_id)
            self._running -= 1
            job.post(exc)
            return False, None

    def _taken_all(self, jobs: list[_Job]) -> list[_Job]:
        for job in jobs:
            self._taken(job)
        return jobs

    def _drafter_state(self, decoder: SpecDecoder):
        """The proposer's state for the prefix cache (None: it keeps none)."""
        return decoder.proposer.snapshot() if self.drafting.cache_id is not None else None

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
