"""The models a gateway serves: loading them, their engines, their policy."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from engines import registry
from engines.base import CacheSettings, Engine, LiveState
from engines.builders.builtin_models import resolve_builtin
from gateway.admission import ModelGate
from gateway.config import Config, LlamaServerConfig, ModelConfig, PrefixCacheConfig
from policies.model_policy import LivePolicy, build_policy, timed_methods

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0  # at shutdown, for the prefix caches' queued disk writes


@dataclass
class ServedModel:
    config: ModelConfig
    engines: dict[str, Engine] = field(default_factory=dict)  # by engine name
    refused: dict[str, str] = field(default_factory=dict)  # configured engine -> why not built
    policy: LivePolicy | None = None  # once loaded
    error: str | None = None
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    unloaded: bool = False  # by an admin (POST /admin/models/{id}/unload)
    gate: ModelGate = field(init=False)  # admission, fair across keys
    cache_share: str = "system"  # the server's prefix_cache.share

    def __post_init__(self) -> None:
        c = self.config
        self.gate = ModelGate(c.max_concurrent, c.max_queue, c.max_queue_wait_s)

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
        """ready | unhealthy | failed | unloaded | loading, as /ready reports it."""
        if self.engine is not None:
            return "unhealthy" if self.problem else "ready"
        return "failed" if self.error else "unloaded" if self.unloaded else "loading"

    @property
    def problem(self) -> str | None:
        """Why the model cannot serve: its load error, or an engine's problem."""
        if self.error:
            return self.error
        problems = [p for e in self.engines.values() if (p := e.problem())]
        return "; ".join(problems) or None

    def live_state(self) -> LiveState:
        """What its engines are doing: decoding, and queued inside them."""
        states = [e.live_state() for e in self.engines.values()]
        return LiveState(
            active_requests=sum(s.active_requests for s in states),
            waiting_requests=sum(s.waiting_requests for s in states),
            context_tokens=0,
        )

    def planning_state(self) -> LiveState:
        """What the policy plans around: the engines' state, plus requests
        holding a slot that have not reached an engine yet and those queued
        for a slot. In a burst, the second request is planned before the
        first has reached its engine: it must count."""
        engines = self.live_state()
        return LiveState(
            active_requests=max(engines.active_requests, self.gate.running - engines.waiting_requests),
            waiting_requests=engines.waiting_requests + self.gate.waiting,
            context_tokens=0,
        )


def build_context(mc: ModelConfig, llama_server: LlamaServerConfig,
                  prefix_cache: PrefixCacheConfig | None = None) -> registry.BuildContext:  # fmt: skip
    """What the model's engines are built from (engines/registry.py), as plain values."""
    lc, pc = mc.llamacpp, prefix_cache or PrefixCacheConfig()
    return registry.BuildContext(
        mc.id, resolve_builtin(mc.path), mc.format, tuple(mc.engines),
        max_context=mc.max_context, max_concurrent=mc.max_concurrent, max_queue=mc.max_queue,
        prefix_cache_size=mc.prefix_cache_size, kernels=mc.kernels, mtp_depth=mc.mtp_depth,
        block_depth=mc.block_depth, ngram_depth=mc.ngram_depth, llamacpp_ngram=lc.ngram_type,
        drafter=resolve_builtin(mc.drafter) if mc.drafter else None,
        prefix_cache=CacheSettings(pc.ram_bytes, pc.disk_bytes, pc.disk_min_tokens,
                                   pc.snapshot_interval),
        llama_server=registry.LlamaServerSettings(
            binary=llama_server.binary, start_at_boot=lc.start == "boot", idle_ttl=lc.idle_ttl_s,
            threads=lc.threads, extra_args=tuple(lc.extra_args), read_timeout=lc.read_timeout_s,
            progress_timeout=lc.progress_timeout_s, health_interval=lc.health_interval_s,
            health_timeout=lc.health_timeout_s, health_failures=lc.health_failures,
        ),
    )


def _build_engines(
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
    if context.format.in_process and path.is_dir():  # a hub id: tune measures local directories
        from gateway.tuning import TuneFile

        # Read at every decision (one stat): a tune run while serving counts at once.
        prior = TuneFile(path, mc.kernels).costs
    return LivePolicy(policy, live_state=served.planning_state, prior=prior,
                      timed=timed_methods(served.engines), explore_every=mc.policy.explore_every)


def _parameter_count(served: ServedModel) -> int | None:
    loaded = getattr(served.engine, "loaded", None)
    if loaded is None:
        return None  # llama-server's model: not in this process
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(loaded.model.parameters()))


class ModelRegistry:
    def __init__(self, config: Config):
        self.models = {mc.id: ServedModel(mc, cache_share=config.prefix_cache.share)
                       for mc in config.models}  # fmt: skip
        self.llama_server = config.llama_server
        self.prefix_cache = config.prefix_cache
        self.draining = False  # shutting down: no new requests

    def get(self, model_id: str) -> ServedModel | None:
        return self.models.get(model_id)

    @property
    def ready(self) -> bool:
        return all(m.state in ("ready", "unloaded") for m in self.models.values())

    async def load_all(self) -> None:
        """Load models one after another (they share one machine's memory)."""
        for served in self.models.values():
            await self.load(served)

    async def load(self, served: ServedModel) -> None:
        served.loaded.clear()
        served.error, served.unloaded = None, False
        try:
            context, engines, refused = await asyncio.to_thread(
                _build_engines, served.config, self.llama_server, self.prefix_cache
            )
            try:
                for engine in engines.values():
                    await engine.start()
            except BaseException:
                for engine in engines.values():
                    await engine.stop()
                raise
            served.engines, served.refused = engines, refused
            served.policy = _policy(served, context)
            log.info("model %s ready (%s)", served.id, ", ".join(engines))
        except Exception as e:  # one bad model must not take down the others
            served.error = f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", served.id, served.error)
        finally:
            served.loaded.set()

    async def unload(self, served: ServedModel) -> None:
        """Stop its engines and let its memory go; requests decoding on it
        end with an error. `load` brings it back."""
        engines, served.engines, served.policy = served.engines, {}, None
        served.unloaded = True
        for engine in engines.values():
            await engine.stop()
        log.info("model %s unloaded", served.id)

    async def drain(self, grace_s: float) -> None:
        """Shutting down: refuse new requests and the queued ones (503), let
        those decoding finish for up to `grace_s`, then stop every engine, so
        what still runs ends with an error the client can read."""
        self.draining = True
        for served in self.models.values():
            served.gate.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(m.gate.running for m in self.models.values()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        busy = [m.id for m in self.models.values() if m.gate.running]
        if busy:
            log.warning("shutdown grace of %g s over: ending the requests still running on %s",
                        grace_s, ", ".join(busy))  # fmt: skip
        await self.stop_all()

    async def stop_all(self) -> None:
        for served in self.models.values():
            for engine in served.engines.values():
                await engine.stop()
        # The prefix caches' disk writes still queued: a restart reads them.
        from engines.loading import flush_prefix_caches

        try:
            await asyncio.wait_for(asyncio.to_thread(flush_prefix_caches), FLUSH_TIMEOUT_S)
        except TimeoutError:
            log.warning("prefix cache: disk writes still queued after %g s; left unwritten",
                        FLUSH_TIMEOUT_S)  # fmt: skip
