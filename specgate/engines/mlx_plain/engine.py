"""Plain decoding (speculation off) with mlx-lm's continuous batching.

The worker thread (engines/worker.py) owns the `BatchGenerator`; a request
that arrives while others are decoding joins the running batch at the next
step, and one that leaves (finished or cancelled) is removed from it there.

A speculative engine of the same model may hand a sequence over (base.Handoff)
when batching wins, and take it back: when a sequence is alone in the batch,
its planner is asked again after each step. BatchGenerator decodes one step
ahead (after a step its cache already holds the token it just returned, and
the next token is sampled), so a sequence leaving takes that sampled token
along as `pending`: it was drawn from the target's own distribution.

A seeded sampled request samples each token with the noise of its absolute
position (engines/sampling.py), as a speculative engine's verify does, so
its text is the same whichever engine decodes it, handed over or not.

A sequence alone in the batch leaves it and decodes on a lean loop of its
own (lone.py, as mlx-lm's `generate_step` does) until another request
arrives, when it goes back into the batch between two tokens. A request
that finds the engine idle starts there: its prompt is fed on the lone path
too, and joins the batch between two chunks if another request comes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import TokenBuffer, make_prompt_cache

from specgate.engines.base import (
    EngineError,
    EngineOverloaded,
    GenerationRequest,
    Handoff,
    LiveState,
    Planner,
    PrefillProgress,
    RoundStats,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)
from specgate.engines.cache.prefix_cache import snapshot
from specgate.engines.distributed.lockstep import (
    SHARED_PLANS,
    FollowerOut,
    Immediate,
    LockstepBroken,
    pin_seed,
)
from specgate.engines.forwards.quantized_kv import batchable
from specgate.engines.grammar.matcher import GrammarError, GrammarState, masked
from specgate.engines.grammar.thinking import ThinkingState, decoding_state
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_plain.kernels import BatchKernels
from specgate.engines.mlx_plain.lone import LoneSequence, feed
from specgate.engines.sampling import PenaltyState, apply_penalties, reportable, sample
from specgate.engines.settings import EmbeddingSettings, Task
from specgate.engines.worker import STOP_JOIN_S, WorkerEngine, default_prefill_step, deliver
from specgate.kernels import hook, qmm

log = logging.getLogger(__name__)


def greedy_batch_sampler(logprobs: mx.array) -> mx.array:
    # One shared object: BatchGenerator samples a batch in a single call when
    # every row uses the same sampler, which is the common greedy case.
    return mx.argmax(logprobs, axis=-1)


class _RequestSampler:
    """A request's own sampler: its params and the absolute position of the
    token it samples next (a seeded request's noise is the position's).
    BatchGenerator calls it once per token, in order."""

    def __init__(self, request: GenerationRequest, position: int):
        self.params = request.sampling
        self.position = position

    def __call__(self, logprobs: mx.array) -> mx.array:
        token = sample(logprobs, self.params, self.position)
        self.position += 1
        return token


def _float32(context: mx.array, logits: mx.array) -> mx.array:
    """mlx-lm logits processor: the logits in float32 before mlx-lm takes
    their log-softmax, which it would round to the model's dtype (bfloat16:
    0.03 near -5) where a speculative engine samples from float32; a seeded
    request's Gumbel-max choice must see the same numbers."""
    return logits.astype(mx.float32)


class _PenaltyProcessor:
    """mlx-lm logits processor applying specgate.engines.sampling penalties.

    mlx-lm hands it every token in the sequence so far; positions past the
    prompt are the generated ones the presence/frequency penalties count.
    """

    def __init__(self, request: GenerationRequest):
        self.params = request.sampling
        self.prompt = request.prompt_tokens
        self.seen = len(request.prompt_tokens)
        self.state: PenaltyState | None = None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self.state is None:
            self.state = PenaltyState.from_prompt(self.prompt, logits.shape[-1])
        if context.size > self.seen:
            self.state = self.state.advance(context[self.seen :].tolist())
            self.seen = context.size
        return apply_penalties(logits, self.state, self.params)


class _GrammarProcessor:
    """mlx-lm logits processor masking by the request's grammar
    (engines/grammar/matcher.py); like _PenaltyProcessor, it reads the generated
    tokens from the context mlx-lm hands it. Listed after the penalties,
    so the mask comes between them and the sampler's truncation, as in the
    speculative engines."""

    def __init__(self, request: GenerationRequest, grammar: GrammarState | ThinkingState):
        self.grammar = grammar
        self.seen = len(request.prompt_tokens)
        # Raising here would fail the whole batch step: the worker ends this
        # request with the error after the step instead.
        self.error: GrammarError | None = None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self.error is not None:
            return logits
        try:
            if context.size > self.seen:
                self.grammar.advance(context[self.seen :].tolist())
                self.seen = context.size
            return masked(logits, self.grammar.allowed())
        except GrammarError as e:
            self.error = e
            return logits


@dataclass
class _Response:
    """A token the lone loop decoded, shaped as the batch's responses are
    (mlx-lm's GenerationBatch.Response), so both take one path (_event)."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list | None
    all_tokens: list[int] | None


@dataclass
class _Slot:
    """A request while the worker serves it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    detokenizer: Any
    planner: Planner | None = None
    resume: Handoff | None = None
    uid: int | None = None
    cached_tokens: int = 0
    in_cache: int = 0  # tokens its cache held when it joined the batch (its prefill's progress counts on)
    started: bool = False
    generated: int = 0  # output tokens so far, earlier engines' included
    grammar: _GrammarProcessor | None = None
    finished: bool = False  # decoded to its end (WorkerEngine.live_state)
    # What the batch was given for it, kept so that the lone loop and a
    # return to the batch carry on with the same objects (a sampler counts
    # positions, processors keep their state).
    sampler: Any = None
    processors: list = field(default_factory=list)
    stops: Any = None
    # Between its submit and its start: the segments to feed after the
    # `known` tokens its cache holds (see _into_batch).
    start: tuple[list[list[int]], list | None, list[int]] | None = None

    def post(self, item: TokenEvent | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class MLXPlainEngine(WorkerEngine):
    name = "mlx_plain"

    def __init__(
        self,
        model_id: str,
        loaded: LoadedModel,
        *,
        max_context: int,
        max_concurrent: int = 8,
        max_queue: int = 64,
        prefix_cache_size: int = 64,
        prefill_step_size: int | None = None,
        prefill_step_while_decoding: int = 128,
        lone: bool = True,
        task: Task | None = None,
        embedding: EmbeddingSettings | None = None,
        kernels: str = "auto",
        kernel_guard=None,
        kernel_fused_guard=None,
    ):
        """lone: a sequence alone decodes outside the batch (lone.py); off,
        it stays in the batch of one (what the bench compares it with).
        kernels: "auto" proves the small-M kernels in the background and
        then runs batch steps through them (kernels.py); "off" keeps them
        stock. kernel_guard, kernel_fused_guard: the guards to prove with (None:
        SPECGATE_HOME's; a kernel_guard alone fuses no sibling linears)."""
        super().__init__(model_id, loaded, max_context=max_context, task=task, embedding=embedding)
        self.lone = lone
        self.lone_tokens = 0  # decoded by the lone loop (a count the tests read)
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.prefill_step_size = prefill_step_size or default_prefill_step()
        # Each batch step decodes every running sequence and feeds one chunk
        # of the prompts being prefilled: while sequences decode, smaller
        # chunks keep a long prompt (or one whose client hangs up before its
        # first token) from stretching everyone's next token by seconds.
        self.prefill_step_while_decoding = min(prefill_step_while_decoding, self.prefill_step_size)
        self._prefix_cache = loaded.prefix_cache
        # A model over several ranks keeps none (engines/loading.py says why).
        self._prefix_cache.resize(0 if loaded.lockstep is not None else prefix_cache_size)
        self._slots: dict[int, _Slot] = {}  # by BatchGenerator uid (worker only)
        self._batch: BatchGenerator | None = None
        self._waiting: list[_Slot] = []  # submitted, not yet started (worker only)
        self._lone_uid = 0  # a request started alone has a uid of its own, below 0
        self.batch_kernels = BatchKernels(
            f"{model_id} {self.name}", loaded, kernels if self.task == "generate" else "off",
            range(2, min(max_concurrent, qmm.MAX_M) + 1), kernel_guard, kernel_fused_guard)
        self.batch_kernels.start()

    def kernels_ready(self, timeout: float | None = None) -> bool:
        """Waits until the batch steps' path is decided (kernels or stock)."""
        return self.batch_kernels.wait(timeout)

    async def stop(self, grace_s: float | None = None) -> None:
        await asyncio.to_thread(self.batch_kernels.stop, STOP_JOIN_S)  # no new proof starts
        await super().stop(grace_s)

    def generate(
        self, request: GenerationRequest, planner: Planner | None = None,
        resume: Handoff | None = None,
    ) -> AsyncIterator[TokenEvent | RoundStats | Handoff | PrefillProgress]:
        """Stream one request (or continue one handed over). The planner is
        asked again only while the request is alone in the batch."""
        if self._in_flight >= self.max_concurrent + self.max_queue:
            raise EngineOverloaded(
                f"model '{self.model_id}' has {self._in_flight} requests in flight "
                f"(limit {self.max_concurrent} running + {self.max_queue} queued)",
                retry_after=1.0,
            )
        slot = _Slot(
            request, asyncio.get_running_loop(), asyncio.Queue(),
            resume.detokenizer if resume else self.tokenizer.detokenizer, planner, resume,
        )
        return self._consume(slot, slot.out, lambda: self._inbox.put(("cancel", slot)))

    # -- worker thread -----------------------------------------------------

    def _new_batch(self) -> BatchGenerator:
        return BatchGenerator(
            self.loaded.model,
            completion_batch_size=self.max_concurrent,
            prefill_batch_size=min(self.max_concurrent, 8),
            prefill_step_size=self.prefill_step_size,
            sampler=greedy_batch_sampler,
        )

    def _worker(self) -> None:
        self._batch = self._new_batch()
        while True:
            try:
                if not self._take_commands(block=not self._slots):
                    break
                if not self._slots:
                    continue
                self._batch.prefill_step_size = (
                    self.prefill_step_while_decoding if self._running else self.prefill_step_size
                )
                # Only a step that decodes every sequence and prefills none
                # is timed: it is what a plain step costs at this batch size.
                decoding = [s for s in self._slots.values() if s.started]
                timed = len(decoding) == len(self._slots)
                kernels = self.batch_kernels.on
                with self.loaded.lock, hook.kernels(kernels):  # timed inside: not the lock's wait
                    t0 = time.perf_counter()
                    prompt_responses, generation_responses = self._batch.next()
                    seconds = time.perf_counter() - t0
                self._store_prompt_caches(prompt_responses)
                # One wake-up per event loop per step, not one per token.
                by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                for slot, progress in self._prefill_progress(prompt_responses):
                    by_loop.setdefault(slot.loop, []).append((slot.out, progress))
                stats = (self._step_stats(decoding, seconds, kernels) if timed and not prompt_responses
                         else None)  # fmt: skip
                for response in generation_responses:
                    if (made := self._event(response)) is not None:
                        slot, event = made
                        if stats is not None:  # rides on the step's first event
                            by_loop.setdefault(slot.loop, []).append((slot.out, stats))
                            stats = None
                        by_loop.setdefault(slot.loop, []).append((slot.out, event))
                for loop, items in by_loop.items():
                    loop.call_soon_threadsafe(deliver, items)
                self._end_broken_grammars()
                if len(self._slots) == 1:
                    slot = next(iter(self._slots.values()))
                    if not self._maybe_hand_off(slot) and self._may_go_alone(slot):
                        self._alone(slot)
            except Exception as exc:  # a failed step fails its batch, not the server
                log.exception("mlx_plain step failed for model %s", self.model_id)
                if self.loaded.lockstep is not None:
                    exc = self.loaded.lockstep.check(exc)
                for slot in self._slots.values():
                    slot.post(exc)
                self._slots.clear()
                self._running = 0
                self._batch = self._new_batch()
                if isinstance(exc, LockstepBroken):  # a distributed model lost a rank
                    raise exc from None
        for slot in [*self._submitted(), *self._waiting]:  # submitted, never started
            slot.post(self.stopped_error())
        for slot in self._slots.values():
            slot.post(self.stopped_error())
        self._slots.clear()
        self._waiting.clear()

    def _step_stats(self, decoding: list[_Slot], seconds: float, kernels: bool) -> RoundStats:
        contexts = [len(s.request.prompt_tokens) + s.generated for s in decoding]
        return RoundStats(self.model_id, "none", 0, seconds=seconds, batch=len(decoding),
                          context_tokens=sum(contexts) // max(1, len(contexts)),
                          constrained=any(s.grammar is not None and s.grammar.grammar.constraint
                                          is not None for s in decoding),
                          kernels=kernels and len(decoding) > 1)  # fmt: skip

    def _end_broken_grammars(self) -> None:
        """End the requests whose grammar failed in the step (its processor
        kept the error), and only those."""
        for uid, slot in list(self._slots.items()):
            if slot.grammar is not None and slot.grammar.error is not None:
                self._batch.remove([uid])
                del self._slots[uid]
                self._running -= slot.started
                slot.post(slot.grammar.error)

    def _commands(self, block: bool) -> list[tuple[str, _Slot]]:
        """The queued submits and cancels, up to a stop."""
        try:
            commands = [self._inbox.get(timeout=None if block else 0)]
        except queue.Empty:
            return []
        while commands[-1][0] != "stop":
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if self.loaded.lockstep is not None:
            for command, slot in commands:
                if command == "submit":
                    slot.request = pin_seed(slot.request)
        return commands

    # Commands as they travel to the other ranks of a distributed model, and
    # the slots they make there (engines/distributed/lockstep.py).
    @staticmethod
    def _describe(commands: list[tuple[str, _Slot]]) -> list[tuple]:
        return [(c, None if slot is None else
                 (slot.request, slot.resume is not None, slot.planner is not None))
                for c, slot in commands]  # fmt: skip

    def _follow(self, described: list[tuple]) -> list[tuple[str, _Slot]]:
        lockstep, out = self.loaded.lockstep, []
        slots = {s.request.request_id: s for s in self._slots.values()}
        for command, what in described:
            if what is None:
                out.append((command, None))
                continue
            request, resumed, planned = what
            if command == "cancel":
                out.append((command, slots.get(request.request_id)))
                continue
            resume = lockstep.take_handoff(request.request_id) if resumed else None
            # Rank 0's plans are shared: a planner here only says one is asked.
            slot = _Slot(request, Immediate(), FollowerOut(request.request_id, lockstep),
                         resume.detokenizer if resume else self.tokenizer.detokenizer,
                         SHARED_PLANS if planned else None, resume)  # fmt: skip
            slots[request.request_id] = slot
            out.append((command, slot))
        return out

    def _take_commands(self, block: bool) -> bool:
        """Apply queued submits and cancels; False once asked to stop."""
        commands = self._share(lambda: self._commands(block), self._describe, self._follow)
        for command, slot in commands:
            if command == "stop":
                return False
            if slot is None:
                continue
            if command == "submit":
                try:
                    self._insert(slot)
                except Exception as exc:  # this request's problem, not the batch's
                    log.exception("mlx_plain could not start request %s", slot.request.request_id)
                    slot.post(exc)
            elif command == "cancel" and slot in self._waiting:
                self._waiting.remove(slot)
            elif command == "cancel" and slot.uid in self._slots:
                self._batch.remove([slot.uid])
                del self._slots[slot.uid]
                self._running -= slot.started
        self._admit()
        return True

    def _admit(self) -> None:
        """Start the submitted requests: one that finds the engine idle on
        the lone path (lone.py), the others in the batch."""
        waiting, self._waiting = self._waiting, []
        if len(waiting) == 1 and not self._slots and self.lone and self.loaded.lockstep is None:
            self._start_alone(waiting[0])
            return
        for slot in waiting:
            start, slot.start = slot.start, None  # (its cache is the batch's now: not kept twice)
            self._into_batch(slot, *start)

    def _insert(self, slot: _Slot) -> None:
        request, resume = slot.request, slot.resume
        prompt = request.prompt_tokens
        if resume is not None:
            # The handed-over cache holds tokens[:-1]: feed the last one.
            cache, rest, known = resume.cache, resume.tokens[-1:], resume.tokens[:-1]
            slot.generated = resume.generated
        else:
            hit = self._prefix_cache.fetch(request.cache_key(prompt), request.cache_scope)
            cache, slot.cached_tokens = hit.cache, hit.cached
            fed = slot.cached_tokens
            if request.images_end > fed:  # its images, fed here (mlx-lm feeds only tokens)
                try:
                    cache, fed = self._feed_images(request, cache, fed), request.images_end
                except Exception as e:  # this request's alone: the batch goes on
                    slot.post(e if isinstance(e, EngineError) else EngineError(f"its images: {e}"))
                    return
            known = prompt[:fed]
            # One segment per snapshot: BatchGenerator reports each segment's
            # end, where _store_prompt_caches keeps the cache.
            cuts = [fed, *(p for p in self._prefix_cache.snapshot_points(request, hit.cached) if p > fed)]
            rest = [prompt[a:b] for a, b in zip(cuts, [*cuts[1:], len(prompt)], strict=True)]
            slot.post(PrefillProgress(fed, len(prompt), slot.cached_tokens))  # the lookup's outcome
        sampling = request.sampling
        # Where its first sampled token goes: after everything it is fed.
        position = len(resume.tokens) if resume is not None else len(prompt)
        slot.sampler = greedy_batch_sampler if sampling.greedy else _RequestSampler(request, position)
        slot.processors = [_PenaltyProcessor(request)] if sampling.has_penalties else []
        try:
            grammar = decoding_state(self.loaded.grammars, sampling)
        except GrammarError as e:  # this request's alone: the batch goes on
            slot.post(e)
            return
        if grammar is not None:
            slot.grammar = _GrammarProcessor(request, grammar)
            slot.processors.append(slot.grammar)
        if sampling.seed is not None and not sampling.greedy:
            slot.processors.append(_float32)
        slot.stops = StopSequences([[t] for t in sorted(request.stop_token_ids)] or None)
        slot.start = ([rest] if resume is not None else rest, cache, known)
        self._waiting.append(slot)

    def _feed_images(self, request: GenerationRequest, cache: list | None, cached: int) -> list:
        """The prompt from `cached` to its last image, into `cache` (made if
        None), in one forward through the model's image side."""
        vision = self.loaded.vision
        if vision is None:
            raise EngineError(f"this model takes no images: {self.loaded.images_refused or 'text only'}")
        model = self.loaded.model
        cache = cache if cache is not None else make_prompt_cache(model)
        inner = (model.language_model if hasattr(model, "language_model") else model).model
        with self.loaded.lock:
            vision.prefill(lambda tokens, emb: inner(tokens, cache=cache, input_embeddings=emb),
                           cache, inner.embed_tokens, request.prompt_tokens, cached,
                           request.images_end, request.images)  # fmt: skip
            mx.eval([c.state for c in cache])
        return cache

    def _into_batch(self, slot: _Slot, segments: list[list[int]], cache: list | None,
                    known: list[int]) -> None:  # fmt: skip
        """Queue the slot's sequence in the batch: `segments` to feed after
        the `known` tokens its cache holds."""
        slot.in_cache = len(known)
        if cache is None and self.loaded.kv_bits is not None:
            cache = make_prompt_cache(self.loaded.model)  # quantized (quantized_kv.py)
        (slot.uid,) = self._batch.insert_segments(
            [segments],
            max_tokens=[slot.request.max_tokens - slot.generated],
            caches=[batchable(cache)],
            all_tokens=[known],
            samplers=[slot.sampler],
            logits_processors=[slot.processors],
            stop_sequences=[slot.stops],
        )
        self._slots[slot.uid] = slot

    def _plan_elsewhere(self, slot: _Slot):
        """Alone: the request's planner's plan if it names another engine
        (speculation) to take the sequence from here, else None."""
        if slot.planner is None or not slot.started or slot.request.sampling.logprobs:
            return None  # logprobs: the pending token's distribution is not kept
        context = len(slot.request.prompt_tokens) + slot.generated
        plan = self._share(lambda: slot.planner.plan(LiveState(1, 0, context)))
        return None if plan.engine == self.name else plan

    def _maybe_hand_off(self, slot: _Slot) -> bool:
        """Alone in the batch: hand the sequence over if its planner says so."""
        gen = self._batch._generation_batch  # mlx-lm internals, pinned version (uv.lock)
        if slot.uid not in gen.uids:
            return False  # still in prompt processing: no step to hand over yet
        if (plan := self._plan_elsewhere(slot)) is None:
            return False
        pending = int(gen._next_tokens[gen.uids.index(slot.uid)].item())
        (cache, tokens), = self._batch.remove([slot.uid], return_prompt_caches=True).values()
        self._hand_off(slot, plan, cache, tokens, pending)
        return True

    def _hand_off(self, slot: _Slot, plan, cache: list, tokens: list[int], pending: int) -> None:
        mx.eval([c.state for c in cache])  # see base.Handoff
        del self._slots[slot.uid]
        self._running -= 1
        slot.post(Handoff(plan, [*tokens, pending], slot.generated + 1, cache, slot.detokenizer,
                          [pending]))  # fmt: skip

    # -- a sequence alone (lone.py) ---------------------------------------------

    def _may_go_alone(self, slot: _Slot) -> bool:
        # A distributed model's ranks step the batch in lockstep: none leaves it.
        gen = self._batch._generation_batch
        return (self.lone and self.loaded.lockstep is None and slot.uid in gen.uids
                and len(gen) == 1 and self._inbox.empty())  # fmt: skip

    def _start_alone(self, slot: _Slot) -> None:
        """A request that finds the engine idle: feed its prompt on the lone
        path in chunks, then decode it alone. A command arriving between two
        chunks (another request, a cancel) sends the rest to the batch."""
        (segments, cache, tokens), slot.start = slot.start, None
        segments = [list(s) for s in segments if s]
        last = segments[-1].pop()  # fed with the first decoding step
        cache = cache if cache is not None else make_prompt_cache(self.loaded.model)
        tokens, fed, total = list(tokens), 0, sum(map(len, segments))
        self._lone_uid -= 1
        slot.uid = self._lone_uid
        self._slots[slot.uid] = slot
        stream = self._batch.stream
        while segments:
            if not self._inbox.empty():
                del self._slots[slot.uid]
                self._into_batch(slot, [*segments, [last]], cache, tokens)
                return
            chunk = segments[0][: self.prefill_step_size]
            if chunk:
                with self.loaded.lock, hook.kernels(self.batch_kernels.on):
                    feed(self.loaded.model, cache, chunk, stream)
                tokens += chunk
                fed += len(chunk)
                del segments[0][: len(chunk)]
                if fed < total and slot.resume is None:
                    prompt = len(slot.request.prompt_tokens)
                    slot.post(PrefillProgress(min(prompt, slot.cached_tokens + fed), prompt,
                                              slot.cached_tokens))  # fmt: skip
            if not segments[0]:
                segments.pop(0)
                if segments:  # a snapshot point (PrefixCache.snapshot_points): keep the cache there
                    scope = self._prefix_cache.snapshot_scope(slot.request, len(tokens))
                    self._prefix_cache.insert(slot.request.cache_key(tokens), snapshot(cache), scope)
        context = TokenBuffer(tokens) if slot.processors else None
        with self.loaded.lock, hook.kernels(self.batch_kernels.on):
            lone = LoneSequence.after_prompt(self.loaded.model, cache, tokens, last, slot.sampler,
                                             slot.processors, context, stream)  # fmt: skip
        self._decode_alone(slot, lone)

    def _alone(self, slot: _Slot) -> None:
        """Take the batch's one sequence out of it and decode it alone."""
        gen = self._batch._generation_batch
        i = gen.uids.index(slot.uid)
        pending, pending_logprobs = gen._next_tokens[i : i + 1], gen._next_logprobs[i]
        context = gen._token_context[i] if slot.processors else None
        (cache, tokens), = self._batch.remove([slot.uid], return_prompt_caches=True).values()
        lone = LoneSequence(self.loaded.model, cache, tokens, pending, pending_logprobs,
                            slot.sampler, slot.processors, context, self._batch.stream)  # fmt: skip
        self._decode_alone(slot, lone)

    def _decode_alone(self, slot: _Slot, lone: LoneSequence) -> None:
        """Decode on the lone loop until the sequence ends, its client
        leaves, its planner hands it over, or a command arrives (a new
        request: then it goes back into the batch)."""
        last = time.perf_counter()
        timed = slot.started  # a first token's step carries the prompt's last one: not timed
        while True:
            # Here the cache holds lone.tokens and `pending` is sampled, not sent.
            if not self._inbox.empty():
                self._back_into_batch(slot, lone)
                return
            if (plan := self._plan_elsewhere(slot)) is not None:
                self._hand_off(slot, plan, lone.cache, lone.tokens, lone.pending_token())
                return
            with self.loaded.lock, hook.kernels(self.batch_kernels.on):
                token, logprobs = lone.step()
            now = time.perf_counter()
            self.lone_tokens += 1
            if len(lone.tokens) % 256 == 0:
                mx.clear_cache()  # as generate_step: the allocator's cache would grow
            stats = self._step_stats([slot], now - last, False) if timed else None
            last, timed = now, True
            if not self._send(slot, token, logprobs, lone, stats):
                return

    def _send(self, slot: _Slot, token: int, logprobs: mx.array, lone: LoneSequence,
              stats: RoundStats | None = None) -> bool:  # fmt: skip
        """Send a token the lone loop decoded, as a batch step's response
        would be; False once the sequence has ended (or its grammar failed)."""
        length = slot.generated + 1 >= slot.request.max_tokens
        finish = "stop" if token in slot.request.stop_token_ids else "length" if length else None
        response = _Response(slot.uid, token, logprobs, finish,
                             lone.cache if finish else None, lone.tokens if finish else None)  # fmt: skip
        made = self._event(response)
        if made is None:
            return False
        items = [(slot.out, stats)] if stats is not None else []
        slot.loop.call_soon_threadsafe(deliver, [*items, (slot.out, made[1])])
        if finish is None and slot.grammar is not None and slot.grammar.error is not None:
            del self._slots[slot.uid]
            self._running -= 1
            slot.post(slot.grammar.error)
            return False
        return finish is None

    def _back_into_batch(self, slot: _Slot, lone: LoneSequence) -> None:
        """Another request came: send the pending token, then queue the
        sequence in the batch again, its cache holding everything before
        it, so the batch feeds it next."""
        pending = lone.pending_token()
        if not self._send(slot, pending, lone.pending_logprobs, lone):
            return
        del self._slots[slot.uid]
        self._into_batch(slot, [[pending]], lone.cache, lone.tokens)

    def _store_prompt_caches(self, prompt_responses: list) -> None:
        # A segment ends at each snapshot point (PrefixCache.snapshot_points):
        # keep the cache there.
        uids = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt]
        for uid, (cache, tokens) in self._batch.extract_cache(uids).items():
            slot = self._slots.get(uid)
            if tokens and slot is not None:
                scope = self._prefix_cache.snapshot_scope(slot.request, len(tokens))
                self._prefix_cache.insert(slot.request.cache_key(tokens), cache, scope)

    def _prefill_progress(self, prompt_responses: list) -> list[tuple[_Slot, PrefillProgress]]:
        """Where each prompt still prefilling stands (mlx-lm counts the
        tokens it feeds, after those the cache held when it joined: the
        cached ones, and those fed alone before another request came)."""
        out = []
        for r in prompt_responses:
            slot = self._slots.get(r.uid)
            if slot is None or slot.started or slot.resume is not None or r.end_of_prompt:
                continue
            fed, fed_total = r.progress
            # mlx-lm feeds the last prompt token with the first decoding step:
            # at fed_total - 1 the first token follows.
            if fed >= fed_total - 1:
                continue
            total = len(slot.request.prompt_tokens)
            out.append((slot, PrefillProgress(min(total, slot.in_cache + fed), total,
                                              slot.cached_tokens)))  # fmt: skip
        return out

    def _event(self, response: Any) -> tuple[_Slot, TokenEvent] | None:
        """The event a generation response makes for its request."""
        slot = self._slots.get(response.uid)
        if slot is None:
            return None
        if not slot.started:
            slot.started = True
            self._running += 1
        detok = slot.detokenizer
        finish = response.finish_reason
        token_ids: list[int] = []
        if finish != "stop":  # an EOS token ends the text and is not part of it
            token_ids = [response.token]
            detok.add_token(response.token)
            slot.generated += 1
        if finish is not None:
            detok.finalize()
        logprobs = None
        if slot.request.sampling.logprobs and token_ids:
            logprobs = [self._token_logprob(response.token, response.logprobs, slot)]
        event = TokenEvent(
            token_ids=token_ids,
            text=detok.last_segment,
            finish_reason=finish,
            logprobs=logprobs,
            cached_tokens=slot.cached_tokens,
        )
        if finish is not None:
            del self._slots[response.uid]
            self._running -= 1
            slot.finished = True  # (after: see WorkerEngine.live_state)
            if response.prompt_cache is not None and response.all_tokens:
                self._prefix_cache.insert(slot.request.cache_key(response.all_tokens),
                                          response.prompt_cache, slot.request.cache_scope)  # fmt: skip
        return slot, event

    def _token_logprob(self, token: int, logprobs: mx.array, slot: _Slot) -> TokenLogprob:
        logprobs = reportable(logprobs)
        k = slot.request.sampling.top_logprobs
        top: tuple[TopLogprob, ...] = ()
        if k > 0:
            ids = mx.argsort(-logprobs)[:k].tolist()
            values = logprobs[mx.array(ids)].tolist()
            top = tuple(
                TopLogprob(i, self.tokenizer.decode([i]), v) for i, v in zip(ids, values, strict=True)
            )
        return TokenLogprob(token, self.tokenizer.decode([token]), logprobs[token].item(), top)
