"""The models a gateway serves: loading them, their engines, their policy."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgate.engines import registry
from specgate.engines.base import CacheSettings, Engine, LiveState
from specgate.gateway.access.admission import ModelGate
from specgate.gateway.config import Config, LlamaServerConfig, ModelConfig, PrefixCacheConfig
from specgate.gateway.errors import APIError
from specgate.gateway.serving.builtins import resolve_builtin, resolve_model_path
from specgate.gateway.serving.footprint import Footprint, estimate, gib, measured
from specgate.gateway.serving.residency import (
    ModelChanges,
    NeverFits,
    Resident,
    idle_expired,
    make_room,
    model_changes,
)
from specgate.policies.model_policy import LivePolicy, build_policy, timed_methods

log = logging.getLogger(__name__)

STATES = ("loading", "ready", "unhealthy", "failed", "unloaded")  # ServedModel.state
FLUSH_TIMEOUT_S = 30.0  # at shutdown, for the prefix caches' queued disk writes


@dataclass
class ResidencyCounts:
    """Since start, for /metrics."""

    loads: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0  # successful loads, in all
    unloads: dict[str, int] = field(default_factory=dict)  # by reason: idle, evicted, admin, reload


@dataclass
class ServedModel:
    config: ModelConfig
    engines: dict[str, Engine] = field(default_factory=dict)  # by engine name
    refused: dict[str, str] = field(default_factory=dict)  # configured engine -> why not built
    policy: LivePolicy | None = None  # once loaded
    error: str | None = None  # why its last load failed (kept while retried, cleared by a success)
    failures: int = 0  # failed loads in a row: the retry's backoff doubles with each
    retry_at: float = 0.0  # monotonic; before it, a failed model's error is the answer
    gate: ModelGate = field(init=False)  # admission, fair across keys
    cache_share: str = "system"  # the server's prefix_cache.share
    # Residency (gateway/serving/residency.py decides, ModelRegistry carries out).
    loading: asyncio.Task | None = None  # the load in progress
    # A `load: boot` model whose turn to load has not come yet (models boot
    # one after another, from a task the app starts): "loading" to /ready,
    # not "unloaded" as a model loaded on first use would be.
    boot_pending: bool = field(init=False)
    in_use: int = 0  # requests holding it (ModelLeases), from resolve to response end
    answering: int = 0  # of those, ones whose slot went back, their answer still being sent
    load_waiters: int = 0  # requests waiting for it to load
    last_used: float = field(default_factory=time.monotonic)
    estimate: Footprint | None = None  # before loading (None: not known)
    counts: ResidencyCounts = field(default_factory=ResidencyCounts)
    lockstep: Any = None  # a distributed model's (engines/distributed/lockstep.py), once loaded
    # The config's `pin` and `idle_ttl_s`, which an admin may change while it
    # serves (POST /admin/models/{id}/pin, ...): never written to the file,
    # kept by a reload that leaves the model unchanged, gone at a restart.
    pin: bool = field(init=False)
    idle_ttl_s: float | None = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.gate = ModelGate(c.max_concurrent, c.max_queue, c.max_queue_wait_s)
        self.boot_pending = c.load == "boot"  # until ModelRegistry._boot has tried it
        self.pin, self.idle_ttl_s = c.pin, c.idle_ttl_s

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def engine(self) -> Engine | None:
        """The front engine, present once loaded: it tokenizes for all of the
        model's engines (they share one vocabulary) and sets its limits. The
        first built: its format's always-built engine where it has one
        (engines/registry.build_engines builds those first)."""
        return next(iter(self.engines.values()), None)

    @property
    def state(self) -> str:
        """ready | unhealthy | failed | loading | unloaded, as /ready reports
        it ("unloaded": not loaded now; a request loads it)."""
        if self.engine is not None:
            return "unhealthy" if self.problem else "ready"
        if self.loading is not None or self.boot_pending:
            return "loading"
        return "failed" if self.error else "unloaded"

    @property
    def serves(self) -> bool:
        """A request for it can be served: loaded and healthy, or loaded by
        the request (unloaded, or a first load under way). Not while it
        failed to load, nor while that load is tried again."""
        state = self.state
        return state in ("ready", "unloaded") or (state == "loading" and not self.error)

    @property
    def busy(self) -> bool:
        return self.in_use > 0 or self.gate.running > 0 or self.loading is not None

    def memory(self) -> dict[str, int]:
        """Bytes by kind: weights and drafter as measured now (a
        llama-server's resident size grows as it runs), the estimate while
        loading or before its process starts, and the KV reserve the budget
        keeps for it. Empty when it holds nothing."""
        est = self.estimate
        if self.engine is None and self.loading is None:
            return {}
        held = measured(self.engines.values())
        if not held and est is not None:
            held = {"weights": est.weights, "drafter": est.drafter}
        # An engine that knows its KV (a llama-server allocates it whole) says it.
        kv = held.get("kv", est.kv_reserve if est else 0)
        return {"weights": held.get("weights", 0), "drafter": held.get("drafter", 0),
                "kv_reserve": kv}  # fmt: skip

    def resident(self) -> int | None:
        """Its child processes' resident size as measured (weights pages
        touched, KV, buffers: the same memory as memory()'s, counted by
        the OS), None where nothing runs apart (an in-process model)."""
        return measured(self.engines.values()).get("resident")

    def notes(self) -> list[str]:
        """What its engines had to do to serve (e.g. a llama-server retried
        with safer flags), for /v1/models, /admin/models and the admin page."""
        # notes() is optional (the Engine protocol does not ask for it): the
        # llama.cpp engines have it, in-process engines have nothing to say.
        found = [n for e in self.engines.values() for n in getattr(e, "notes", list)()]
        return list(dict.fromkeys(found))  # processes sharing a cause say it once

    @property
    def problem(self) -> str | None:
        """Why the model cannot serve: its load error, or an engine's problem."""
        if self.error:
            return self.error
        problems = [p for e in self.engines.values() if (p := e.problem())]
        return "; ".join(dict.fromkeys(problems)) or None  # engines sharing a cause say it once

    def live_state(self) -> LiveState:
        """What its engines are doing: decoding, and queued inside them."""
        states = [e.live_state() for e in self.engines.values()]
        return LiveState(
            active_requests=sum(s.active_requests for s in states),
            waiting_requests=sum(s.waiting_requests for s in states),
            context_tokens=0,
            finished_requests=sum(s.finished_requests for s in states),
        )

    def planning_state(self, arriving: bool = False) -> LiveState:
        """What the policy plans around: the engines' state, plus requests
        holding a slot that have not reached an engine yet, those queued
        for a slot, and those that have arrived for the model without
        asking for one yet (reading, rendering, tokenizing: `in_use` counts
        them). In a burst, the second request is planned before the first
        has reached its engine, and the first while the others are still
        rendering: they all decode together, so they must all count. One
        its engine has decoded to the end holds its slot until its answer
        is sent, and does not count. `arriving`: the state for planning
        such a request itself, which is not counted."""
        engines = self.live_state()
        holding = self.gate.running - engines.waiting_requests - engines.finished_requests
        # (Not those answering: a request whose slot went back still holds
        # the model until its response has ended. Counted as arriving, it
        # sent a stream it had left alone back to batching for a round.)
        arrived = (self.in_use - self.gate.running - self.gate.waiting - self.answering
                   - (1 if arriving else 0))  # fmt: skip
        return LiveState(
            active_requests=max(engines.active_requests, holding),
            waiting_requests=engines.waiting_requests + self.gate.waiting + max(0, arrived),
            context_tokens=0,
        )


def build_context(mc: ModelConfig, llama_server: LlamaServerConfig,
                  prefix_cache: PrefixCacheConfig | None = None) -> registry.BuildContext:  # fmt: skip
    """What the model's engines are built from (engines/registry.py): the
    model's values, and its engines' settings objects as validated."""
    pc = prefix_cache or PrefixCacheConfig()
    from specgate.gateway.serving.ranks import distribution

    return registry.BuildContext(
        mc.id, resolve_model_path(mc.path), mc.format, tuple(mc.engines),
        max_context=mc.max_context, max_concurrent=mc.max_concurrent, max_queue=mc.max_queue,
        prefix_cache_size=mc.prefix_cache_size,
        # Proving kernels runs forwards at load, before the ranks follow each other.
        kernels="off" if mc.distributed else mc.kernels, distribution=distribution(mc),
        dequantize=mc.dequantize, kv_bits=mc.kv_bits, kv_group_size=mc.kv_group_size,
        settings=mc.engine_settings(),
        drafter=resolve_builtin(mc.drafter) if mc.drafter else None,
        prefix_cache=CacheSettings(pc.ram_bytes, pc.disk_bytes, pc.disk_min_tokens,
                                   pc.snapshot_interval),
        llama_server=mc.llamacpp, llama_server_binary=llama_server.binary,
        chat_template=mc.chat_template_text(), task=mc.task, embedding=mc.embedding,
    )


def build_model_engines(
    mc: ModelConfig, llama_server: LlamaServerConfig, prefix_cache: PrefixCacheConfig
) -> tuple[registry.BuildContext, dict[str, Engine], dict[str, str]]:
    """Blocking (a builtin may be made on first use; weights load, once per
    path): the model's engines, with the configured ones refused and why."""
    context = build_context(mc, llama_server, prefix_cache)
    return (context, *registry.build_engines(context))


def _policy(served: ServedModel, context: registry.BuildContext) -> LivePolicy:
    mc = served.config
    policy = build_policy(served.id, served.engines, served.refused, mc.policy,
                          context=context, params=_parameter_count(served))  # fmt: skip
    prior = lambda: None  # noqa: E731
    path = Path(context.path)
    # A hub id: tune measures local directories; and it measures the stored
    # weights, not a `dequantize`d load of them.
    if context.format.in_process and path.is_dir() and not context.dequantize:
        from specgate.gateway.serving.tuning import TuneFile

        # Read at every decision (one stat): a tune run while serving counts at once.
        prior = TuneFile(path, mc.kernels).costs
    return LivePolicy(policy, live_state=served.planning_state, prior=prior,
                      timed=timed_methods(served.engines), explore_every=mc.policy.explore_every,
                      request_floor=mc.policy.request_floor)


def _parameter_count(served: ServedModel) -> int | None:
    loaded = getattr(served.engine, "loaded", None)
    if loaded is None:
        return None  # llama-server's model: not in this process
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(loaded.model.parameters()))


@dataclass
class _Lease:
    """One HTTP request's hold on models (ModelLeases sets it): those it
    acquired, from resolve_model until its response has ended (streams
    included), and those whose slot it gave back while its answer is still
    being sent (`answering`)."""

    held: list[ServedModel] = field(default_factory=list)
    answering: list[ServedModel] = field(default_factory=list)
    ended: bool = False  # the response has ended (a cancelled stream's generation may end after)


_leases: contextvars.ContextVar[_Lease | None] = contextvars.ContextVar("model_leases", default=None)


def answering(served: ServedModel, gave_back: bool) -> None:
    """This request gave its slot on `served` back (`gave_back`), its answer
    maybe still on its way; or it took one again. Meanwhile it holds the
    model but is not one that has yet to take a slot (planning_state)."""
    lease = _leases.get()
    if lease is None or lease.ended or (served in lease.answering) == gave_back:
        return  # (no HTTP request: a test's direct call)
    if gave_back:
        lease.answering.append(served)
        served.answering += 1
    else:
        lease.answering.remove(served)
        served.answering -= 1

IDLE_CHECK_S = 1.0  # how often idle TTLs and failed boot models' retries are checked
ROOM_RETRY_S = 0.25  # waiting for busy models to go idle, to make room


class ModelRegistry:
    """The configured models and their residency: loaded at start or on a
    first request, unloaded when idle past their TTL, evicted least
    recently used when another needs room under `server.memory_budget`."""

    def __init__(self, config: Config):
        self.models = {mc.id: ServedModel(mc, cache_share=config.prefix_cache.share)
                       for mc in config.models}  # fmt: skip
        self.retiring: list[ServedModel] = []  # removed or changed by a reload, still busy
        self.llama_server = config.llama_server
        # The prefix cache's RAM is fixed for the server's life (a reload
        # keeps the running prefix_cache section); memory_budget may change.
        self.prefix_cache_budget = config.budgets().prefix_cache
        self.prefix_cache = config.prefix_cache.model_copy(update={"ram_bytes": self.prefix_cache_budget})
        self.draining = False  # shutting down: no new requests
        self.load_retry = (config.server.load_retry_min_s, config.server.load_retry_max_s)
        self._set_budget(config)
        self._room = asyncio.Lock()  # one residency change at a time
        self._watch: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # boots and retirements a reload started

    def _set_budget(self, config: Config) -> None:
        # The prefix cache's RAM comes off the top: what is left is the models'.
        self.memory_budget = config.budgets().memory
        self.models_budget = self.memory_budget - self.prefix_cache_budget

    def get(self, model_id: str) -> ServedModel | None:
        return self.models.get(model_id)

    @property
    def ready(self) -> bool:
        """What /ready says: every `load: boot` model has been tried, no
        model is unhealthy (an engine stuck, dead or restarting), and some
        model can serve. A model whose
        load failed does not hold the node back while another serves (a
        load balancer would pull them all for one); it is retried, and
        /v1/models, /admin/status and /metrics say why it failed. With every
        model failed, the node is not ready."""
        models = list(self.models.values())
        if any(m.boot_pending or m.state == "unhealthy" for m in models):
            return False
        return not models or any(m.serves for m in models)

    async def start(self) -> None:
        """Load the `load: boot` models one after another (they share one
        machine's memory), and watch idle TTLs and failed loads from now on."""
        self._watch = asyncio.create_task(self._watch_residency())
        for served in list(self.models.values()):
            if served.config.load == "boot":
                await self._boot(served)

    async def _boot(self, served: ServedModel) -> None:
        try:
            await self.ensure_loaded(served)
        except APIError:
            pass  # logged; it stays failed, and /ready says so
        finally:
            served.boot_pending = False

    # -- reloading the config ---------------------------------------------------------

    async def reconfigure(self, config: Config) -> ModelChanges:
        """Serve `config`'s models from now on: added ones appear (loading at
        once if `load: boot`), removed ones leave /v1/models and unload once
        their requests have finished, changed ones are served by a fresh
        model (loaded anew) while the old one finishes its requests;
        unchanged ones are untouched, streams and caches included."""
        new = {mc.id: mc for mc in config.models}
        changes = model_changes({i: m.config for i, m in self.models.items()}, new)
        async with self._room:
            old, fresh = self.models, []
            models = {}
            for model_id, mc in new.items():
                if model_id in changes.unchanged:
                    models[model_id] = old[model_id]
                else:
                    models[model_id] = ServedModel(mc, cache_share=config.prefix_cache.share)
                    fresh.append(models[model_id])
            self.models = models
            leaving = [old[i] for i in changes.removed + changes.changed]
            self.retiring += leaving
            self._set_budget(config)
        for served in leaving:
            self._spawn(self._retire(served))
        for served in fresh:
            if served.config.load == "boot":
                self._spawn(self._boot(served))
        log.info("config reloaded: added %s, removed %s, changed %s", list(changes.added),
                 list(changes.removed), list(changes.changed))  # fmt: skip
        return changes

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, served: ServedModel) -> None:
        """A model a reload removed or replaced: unloaded once idle."""
        while served.busy:
            await asyncio.sleep(ROOM_RETRY_S)
        async with self._room:
            await self._unload(served, "reload")
            self.retiring.remove(served)

    # -- requests ---------------------------------------------------------------------

    async def acquire(self, served: ServedModel) -> None:
        """A request's hold on `served`, loaded (loading it first if need
        be, waiting like the admission queue: 429 past max_queue waiting,
        503 past max_queue_wait_s). Released when its response ends."""
        lease = _leases.get()
        if lease is not None:
            lease.held.append(served)
            served.in_use += 1
        served.last_used = time.monotonic()
        if served.engine is not None:
            return
        mc = served.config
        if served.load_waiters >= mc.max_concurrent + mc.max_queue:  # as many as the gate takes
            raise APIError(429, f"model '{served.id}' is loading and {served.load_waiters} "
                           "requests already wait for it", code="overloaded",
                           headers={"Retry-After": "5"})  # fmt: skip
        served.load_waiters += 1
        try:
            await self.ensure_loaded(served, wait_s=mc.max_queue_wait_s, retry_failed=False)
        finally:
            served.load_waiters -= 1

    def release(self, served: ServedModel) -> None:
        served.in_use -= 1
        served.last_used = time.monotonic()

    # -- loading ----------------------------------------------------------------------

    async def ensure_loaded(self, served: ServedModel, wait_s: float | None = None,
                            retry_failed: bool = True) -> None:  # fmt: skip
        """Load `served` unless it is; APIError (503) if it cannot be, or not
        within `wait_s`. A model whose last load failed is tried again once
        its backoff is over, or at once with `retry_failed` (an admin's
        load); until then its error is the answer."""
        if served.engine is not None:
            return
        if served.loading is None:
            if served.error and not retry_failed and time.monotonic() < served.retry_at:
                raise _load_failed(served)
            served.loading = asyncio.create_task(self._load(served))
        try:
            await asyncio.wait_for(asyncio.shield(served.loading), wait_s)
        except TimeoutError:
            raise APIError(503, f"model '{served.id}' is still loading",
                           code="model_loading", headers={"Retry-After": "5"}) from None  # fmt: skip
        if served.engine is None:
            raise _load_failed(served)

    async def _load(self, served: ServedModel) -> None:
        t0 = time.monotonic()
        try:
            if served.estimate is None:
                served.estimate = await asyncio.to_thread(estimate, served.config)
            await self._make_room(served)
            context, engines, refused = await asyncio.to_thread(
                build_model_engines, served.config, self.llama_server, self.prefix_cache
            )
            lockstep = context.loaded.lockstep if context.loaded is not None else None
            try:
                for engine in engines.values():
                    await engine.start()
                if lockstep is not None:  # its other ranks follow from here
                    await asyncio.to_thread(lockstep.begin)
            except BaseException:
                for engine in engines.values():
                    await engine.stop()
                raise
            # From here to the policy, nothing awaits: a request may come as
            # soon as the model has engines.
            served.engines, served.refused, served.lockstep = engines, refused, lockstep
            served.error, served.failures = None, 0
            served.policy = _policy(served, context)
            served.counts.loads += 1
            served.counts.load_seconds += time.monotonic() - t0
            log.info("model %s ready (%s) in %.1f s, %s", served.id, ", ".join(engines),
                     time.monotonic() - t0, _held(served))  # fmt: skip
        except Exception as e:  # one bad model must not take down the others
            served.error = str(e) if isinstance(e, _CannotFit) else f"{type(e).__name__}: {e}"
            served.counts.load_failures += 1
            served.failures += 1
            low, high = self.load_retry
            backoff = min(high, low * 2 ** min(served.failures - 1, 30))
            served.retry_at = time.monotonic() + backoff
            log.error("model %s failed to load: %s (next try in %g s)", served.id, served.error,
                      backoff)  # fmt: skip
        finally:
            served.last_used = time.monotonic()
            served.loading = None

    async def _make_room(self, served: ServedModel) -> None:
        """Evict what the residency rules say, or wait for busy models; raise
        _CannotFit when the model could never fit."""
        need = served.estimate.total if served.estimate else 0
        while True:
            async with self._room:
                others = [_resident(m) for m in [*self.models.values(), *self.retiring]
                          if m is not served and (m.engine is not None or m.loading is not None)]  # fmt: skip
                room = make_room(need, self.models_budget, others)
                if isinstance(room, NeverFits):
                    raise _CannotFit(self._never_fits(served, room))
                for victim in room.evict:
                    log.info("model %s unloaded to make room for %s", victim, served.id)
                    await self._unload(self.models[victim], "evicted")
                if not room.wait:
                    return
            await asyncio.sleep(ROOM_RETRY_S)

    def _never_fits(self, served: ServedModel, room: NeverFits) -> str:
        pinned = (f"; pinned models hold {gib(room.pinned_bytes)} ({', '.join(room.pinned)})"
                  if room.pinned else "")  # fmt: skip
        return (f"model '{served.id}' needs about {served.estimate.describe()}, more than the "
                f"{gib(self.models_budget)} models may use (server.memory_budget "
                f"{gib(self.memory_budget)} less the prefix caches' RAM{pinned}); raise "
                "memory_budget, set a smaller max_context or max_concurrent, or unpin a model")

    # -- unloading --------------------------------------------------------------------

    async def unload(self, served: ServedModel, reason: str = "admin") -> None:
        """Stop its engines and let its memory go; requests decoding on it
        end with an error. The next request loads it again."""
        async with self._room:
            await self._unload(served, reason)

    async def _unload(self, served: ServedModel, reason: str) -> None:
        engines, served.engines, served.policy = served.engines, {}, None
        if not engines:
            return
        await _stop_engines(served, engines.values())
        served.counts.unloads[reason] = served.counts.unloads.get(reason, 0) + 1
        log.info("model %s unloaded (%s)", served.id, reason)

    async def _watch_residency(self) -> None:
        """Unload what is idle past its TTL; try failed boot models again."""
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            now = time.monotonic()
            for served in list(self.models.values()):
                if _retry_due(served, now) and not self.draining:
                    served.loading = asyncio.create_task(self._load(served))
                if served.engine is not None and idle_expired(now, served.last_used,
                                                              served.idle_ttl_s, served.busy,
                                                              served.pin):  # fmt: skip
                    try:
                        async with self._room:
                            if not served.busy:  # a request may have come meanwhile
                                await self._unload(served, "idle")
                    except Exception:  # the watch must go on for the other models
                        log.exception("model %s: idle unload failed", served.id)

    async def drain(self, grace_s: float) -> None:
        """Shutting down: refuse new requests and the queued ones (503), let
        those decoding finish, then stop every engine, so what still runs
        ends with an error the client can read. One grace period covers it
        all: the requests have until its end, and the engines stop together
        in what is left of it (a llama-server still running at its end is
        killed), not one after another with a grace each."""
        self.draining = True
        every = [*self.models.values(), *self.retiring]
        for served in every:
            served.gate.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(m.gate.running for m in every) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        busy = [m.id for m in every if m.gate.running]
        if busy:
            log.warning("shutdown grace of %g s over: ending the requests still running on %s",
                        grace_s, ", ".join(busy))  # fmt: skip
        await self.stop_all(max(0.0, deadline - loop.time()))

    async def stop_all(self, grace_s: float | None = None) -> None:
        """Stop every model's engines at once; a child process gets `grace_s`
        to exit before it is killed (None: its engine's own setting)."""
        if self._watch is not None:
            self._watch.cancel()
        for task in list(self._tasks):
            task.cancel()
        every = [*self.models.values(), *self.retiring]
        for served in every:
            if served.loading is not None:
                served.loading.cancel()
        await asyncio.gather(*(_stop_engines(m, m.engines.values(), grace_s) for m in every))
        # The prefix caches' disk writes still queued: a restart reads them.
        from specgate.engines.loading import flush_prefix_caches

        try:
            await asyncio.wait_for(asyncio.to_thread(flush_prefix_caches), FLUSH_TIMEOUT_S)
        except TimeoutError:
            log.warning("prefix cache: disk writes still queued after %g s; left unwritten",
                        FLUSH_TIMEOUT_S)  # fmt: skip


RANKS_STOP_S = 10.0  # telling a distributed model's other ranks to end


async def _stop_engines(served: ServedModel, engines, grace_s: float | None = None) -> None:
    """Stop `engines` (the model's) together, then its other ranks, if any.
    One that fails to stop is logged: the others stop all the same."""
    results = await asyncio.gather(*(e.stop(grace_s) for e in engines), return_exceptions=True)
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException):
            log.error("model %s: stopping %s failed: %r", served.id,
                      getattr(engine, "name", "an engine"), result)  # fmt: skip
    await _release_ranks(served)


async def _release_ranks(served: ServedModel) -> None:
    """A distributed model's engines stopped: its other ranks end too."""
    lockstep, served.lockstep = served.lockstep, None
    if lockstep is not None:
        try:
            await asyncio.wait_for(asyncio.to_thread(lockstep.stop), RANKS_STOP_S)
        except TimeoutError:
            log.warning("model %s: its other ranks did not take the stop within %g s",
                        served.id, RANKS_STOP_S)  # fmt: skip


def _load_failed(served: ServedModel) -> APIError:
    wait = max(1, round(served.retry_at - time.monotonic()))
    return APIError(503, f"model '{served.id}' failed to load: {served.error} (next try in "
                    f"{wait} s)", code="model_failed", headers={"Retry-After": str(wait)})  # fmt: skip


def _retry_due(served: ServedModel, now: float) -> bool:
    """A `load: boot` model whose load failed, its backoff over. (One loaded
    on demand is tried again by a request; a distributed one not at all: its
    other ranks load it once, as they start.)"""
    mc = served.config
    return (mc.load == "boot" and mc.distributed is None and served.error is not None
            and served.engine is None and served.loading is None and not served.boot_pending
            and now >= served.retry_at)  # fmt: skip


class _CannotFit(Exception):
    """A model bigger than the memory budget allows: the message has the numbers."""


def _resident(served: ServedModel) -> Resident:
    nbytes = sum(served.memory().values())
    return Resident(served.id, nbytes, served.last_used, served.pin, served.busy)


def _held(served: ServedModel) -> str:
    parts = [f"{kind} {gib(n)}" for kind, n in served.memory().items() if n]
    return ", ".join(parts) or "memory not measured"


def model_status(served: ServedModel) -> dict:
    """What GET /admin/models says of one model."""
    mc, est = served.config, served.estimate
    return {
        "id": served.id, "state": served.state, "engines": list(served.engines) or mc.engines,
        "memory": served.memory(), "estimate": est.total if est else None,
        "resident": served.resident(), "notes": served.notes(),
        "in_flight": served.in_use, "idle_s": round(time.monotonic() - served.last_used, 1),
        "load": mc.load, "pin": served.pin, "idle_ttl_s": served.idle_ttl_s,
        "task": getattr(served.engine, "task", None) or mc.task or "generate", "kv_bits": mc.kv_bits,
        # What the config file says, where an admin changed it while serving.
        "configured": {k: v for k, v in (("pin", mc.pin), ("idle_ttl_s", mc.idle_ttl_s))
                       if v != getattr(served, k)},
        "error": served.error, "loads": served.counts.loads, "failures": served.failures,
        "retry_in_s": (round(max(0.0, served.retry_at - time.monotonic()), 1)
                       if served.error and served.engine is None else None),
    }  # fmt: skip


class ModelLeases:
    """ASGI middleware: the models a request acquired (ModelRegistry.acquire)
    are released when its response has ended, streamed bodies included, so
    idle TTLs and evictions never take a model from under a request."""

    def __init__(self, app, registry: ModelRegistry):
        self.app, self.registry = app, registry

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lease = _Lease()
        token = _leases.set(lease)
        try:
            await self.app(scope, receive, send)
        finally:
            _leases.reset(token)
            lease.ended = True
            for served in lease.answering:
                served.answering -= 1
            for served in lease.held:
                self.registry.release(served)
