"""The shell of every in-process speculative engine: MTP, DFlash, DSpark,
Gemma-4 assistants, n-gram copies and mtp+ngram (engines/drafting/).

Speculation serves one sequence at a time (batching is the plain engine's
job: a policy sends concurrent load there). A worker thread owns the model
work; requests queue FIFO behind the one being decoded, and the planner is
asked for the depth at every round, so it can also switch speculation off
(depth 0) between rounds. One class serves every method: it is built with
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
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from specgate.engines.base import (
    EngineError,
    EngineOverloaded,
    GenerationRequest,
    Handoff,
    HeldMemory,
    LiveState,
    Method,
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


class SpecEngine(WorkerEngine):
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
        self.max_drafts = self.drafting.max_drafts
        self.kernels_setting = kernels
        # Greedy MTP rounds queued one ahead (mlx_spec/ahead.py) where a GPU
        # runs them: there the host's work per round is the cost it hides.
        self.ahead = mx.default_device() == mx.gpu
        # ... each round compiled once per shape and replayed (ahead_round.py)
        self.compiled_rounds = self.ahead
        self._rounds: CompiledRounds | None = None
        self.kernel_guard = kernel_guard  # None: specgate.engines.kernel_wiring.shared_guard()
        self.kernel_switch: KernelSwitch | None = None  # set by wire_kernels
        depth = settings.depth or self.max_drafts or DEFAULT_VERIFY_DEPTH
        self.wire_kernels(depth if self.max_drafts is None else min(depth, self.max_drafts))

    def wire_kernels(self, max_depth: int) -> None:
        """Small-M kernels for this engine's verify forwards (kernels/wiring.py):
        the hook on a quantized trunk unless `kernels: off`, every verify
        width 2..max_depth+1 proved before a round uses it. Verdicts recorded
        for this machine wire them now; missing ones are proved in the
        background (engines/mlx_spec/kernel_proofs.py) while the engine
        serves on the stock verify path."""
        self.kernel_switch = KernelSwitch(f"{self.model_id} {self.name}", self.loaded,
                                          self.target, self.kernels_setting,
                                          range(2, max_depth + 2), self.kernel_guard,
                                          self.drafting.kernel_module)  # fmt: skip
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
        if not (self.ahead and AheadDecoder.fits(self.target, proposer, request, grammar)):
            return SpecDecoder(*args, grammar=grammar)
        if self.compiled_rounds and self._rounds is None:  # the engine's head: one for every request
            self._rounds = CompiledRounds(self.target, proposer.head)
        return AheadDecoder(*args, grammar=grammar,
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
        request, resume = job.request, job.resume
        prefix, lock = self.loaded.prefix_cache, self.loaded.lock
        cache_id = self.drafting.cache_id
        hit = (
            Hit(resume.cache, 0)
            if resume
            else prefix.fetch(request.prompt_tokens, request.cache_scope, cache_id)
        )
        cached = hit.cached
        decoder = self.make_decoder(request, hit.cache, cached)
        if hit.drafter is not None:
            decoder.proposer.restore(hit.drafter)
        detok = resume.detokenizer if resume else self.tokenizer.detokenizer
        if resume is not None:
            with lock:
                step = decoder.resume(resume)
        else:
            # The lock is taken per chunk, and a request that went away stops
            # within one chunk: a long prompt nobody waits for must not hold
            # the model (or, through its lock, its plain engine) for minutes.
            points = prefix.snapshot_points(request, cached)
            chunks, fed, total = decoder.prefill_chunks(points), cached, len(request.prompt_tokens)
            while fed < total:
                if self._gone(job):
                    log.info("%s %s: request %s stopped after prefilling %d of %d prompt tokens",
                             self.model_id, self.name, request.request_id, fed, total)
                    return
                with lock:
                    fed = next(chunks)
                if fed < total:
                    job.post(PrefillProgress(fed, total, cached))
                if fed in points:
                    prefix.insert(request.prompt_tokens[:fed], snapshot(decoder.cache),
                                  prefix.snapshot_scope(request, fed), drafter=cache_id,
                                  drafter_state=self._drafter_state(decoder))  # fmt: skip
            with lock:
                step = decoder.first_token()
        while True:
            if step.finish_reason is not None:
                # Not running any more before the client can hear so: its next
                # request must not find this one still counted as in flight.
                self._running = 0
                job.finished = True  # (after: see WorkerEngine.live_state)
                job.post(*self._events(step, detok, cached))
                prefix.insert(decoder.tokens[:-1], decoder.cache, request.cache_scope,
                              drafter=cache_id, drafter_state=self._drafter_state(decoder))
                return
            job.post(*self._events(step, detok, cached))
            jobs, why, plan = self._share_between_rounds(job, waiting, decoder)
            waiting.extend(jobs)
            if self._ended(job, why):
                return
            if plan.engine != self.name:  # e.g. batching: another request arrived
                handoff = decoder.handoff(plan, detok)
                self._running = 0
                job.post(handoff)
                return
            depth = plan.depth if plan.method == self.method else 0
            with lock:
                step = decoder.round(depth)

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
