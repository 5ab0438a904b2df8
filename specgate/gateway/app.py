"""The FastAPI app: wiring of routes, keys, limits, errors and model lifecycle.

Admin routes (an admin key; any caller on an open loopback server):
`POST /admin/reload` re-reads the keys file and the config file
(gateway/serving/reloading.py), `GET /admin/models` lists the models with their
residency, `POST /admin/models/{id}/unload` and `.../load` stop a model's
engines to free its memory and bring it back (a request for an unloaded
model loads it again, too), and `.../pin`, `.../unpin` and `.../idle_ttl`
change its residency while it serves (not written to the config file).
`GET /admin/status` feeds the admin page at `/`: everything for an admin,
a read-only view for a loopback client with no key, a key's own usage for
any other key (gateway/operator/status.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from specgate.engines.grammar.sandbox import SANDBOX
from specgate.gateway.access.access_log import AccessLog, AccessLogMiddleware
from specgate.gateway.access.auth import (
    AuthMiddleware,
    FailedAuthLimiter,
    KeyStore,
    current_principal,
    is_loopback,
    presented_key,
)
from specgate.gateway.access.limits import BodyLimitMiddleware
from specgate.gateway.api import ollama_api, openai_api
from specgate.gateway.api.anthropic_api import router as anthropic_router
from specgate.gateway.api.responses_api import ResponseStore
from specgate.gateway.api.responses_api import router as responses_router
from specgate.gateway.api.retrieval.routes import ollama_router as ollama_retrieval_router
from specgate.gateway.api.retrieval.routes import router as retrieval_router
from specgate.gateway.cluster.peers import Peers, peer_status
from specgate.gateway.cluster.proxy import PeerRouter
from specgate.gateway.config import Config
from specgate.gateway.errors import APIError, install_error_handlers
from specgate.gateway.operator.history import History
from specgate.gateway.operator.status import RecentErrors, own_status, read_only, status
from specgate.gateway.operator.status import page as admin_page_html
from specgate.gateway.serving.loop_watch import LoopWatch
from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.model_card import ModelCards
from specgate.gateway.serving.models import ModelLeases, ModelRegistry, model_status
from specgate.gateway.serving.reloading import Reloader, ReloadRefused

log = logging.getLogger(__name__)


def create_app(config: Config, config_path: str | Path | None = None,
               overrides: dict | None = None) -> FastAPI:  # fmt: skip
    """KeyFileError if the keys file cannot be used. config_path: the file
    `config` came from, re-read by a reload (with the command line's
    `overrides` of server settings applied again)."""
    registry = ModelRegistry(config)
    keys = KeyStore(config.auth.keys_path, open_when_empty=is_loopback(config.server.host))
    if keys.empty:
        log.info("no API keys in %s: open to loopback clients", keys.path)
    else:
        log.info("%d API keys from %s", len(keys.names), keys.path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Models load in the background so /health answers at once and
        # /ready tells when serving can start.
        loading = asyncio.create_task(registry.start())
        hangup = _on_sighup(reloader)
        errors.attach()
        sampling = asyncio.create_task(history.run())  # the admin page's last hour
        watch = LoopWatch(asyncio.get_running_loop()).start()
        await peers.start()
        try:
            yield
        finally:
            watch.stop()
            sampling.cancel()
            errors.detach()
            hangup()
            loading.cancel()
            await peers.stop()
            await registry.stop_all()
            await SANDBOX.close()

    app = FastAPI(title="specgate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.registry = registry
    app.state.started_at = int(time.time())
    app.state.metrics = metrics = Metrics(registry)
    app.state.keys = keys
    # Its `recent` requests (dicts, newest last) are the admin page's.
    app.state.access_log = access_log = AccessLog()
    app.state.keepalive_s = config.server.stream_keepalive_s  # gateway/api/chat.py, FirstPiece
    app.state.image_urls = config.server.image_urls  # gateway/serving/images.py
    app.state.model_cards = ModelCards()  # Ollama's model listing (gateway/api/ollama_api.py)
    kept = config.server.responses_store  # for previous_response_id (gateway/api/responses_api.py)
    app.state.responses = ResponseStore(kept.responses_per_key, kept.bytes_per_key)
    app.state.peers = metrics.peers = peers = Peers(config.peers)  # gateway/cluster/peers.py, proxy.py
    reloader = Reloader(registry, keys, config, Path(config_path) if config_path else None,
                        overrides or {})  # fmt: skip
    errors = RecentErrors()  # the admin page's "recent warnings and errors"
    app.state.history = history = History(registry, metrics)
    install_error_handlers(app)

    # HEAD / too: tools that speak Ollama's API check that a server is up with it.
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    @app.get("/ui", include_in_schema=False)
    async def admin_page():
        """The admin page: static, its data from /admin/status (gateway/operator/status.py)."""
        return Response(admin_page_html(), media_type="text/html; charset=utf-8", headers={
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                       "style-src 'unsafe-inline'; frame-ancestors 'none'",
            "Cache-Control": "no-cache"})  # fmt: skip

    @app.get("/admin/status")
    async def status_data():
        principal = current_principal()
        access_log = getattr(app.state, "access_log", None)
        if not (principal.admin or principal.viewer):
            return own_status(principal, registry, metrics, access_log)
        full = status(registry, metrics, errors, keys, access_log, history)
        full["peers"] = peer_status(peers)
        return full if principal.admin else read_only(full)

    # Before the OpenAI router's own /v1/models, which lists this node's
    # models: the peers' are added, and a key sees only the models it may use.
    @app.get("/v1/models")
    async def list_models(request: Request):
        listing = await openai_api.list_models(request)
        if peers:
            listing["data"] = peers.listing(listing["data"], app.state.started_at)
        principal = current_principal()
        listing["data"] = [m for m in listing["data"] if principal.may_use(m["id"])]
        return listing

    app.include_router(openai_api.router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    app.include_router(ollama_api.router)
    app.include_router(retrieval_router)
    app.include_router(ollama_retrieval_router)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        """Open to anyone (load balancers, probes): ready or not. Each model's
        state and errors (file paths, engine problems) only for an admin key,
        or anyone on an open loopback server."""
        ok = registry.ready and not registry.draining
        if not registry.models:  # a front for its peers: ready while one of them is
            ok = ok and any(n.up for n in peers.nodes.values())
        body: dict = {"status": "ready" if ok else "not_ready"}
        if registry.draining:
            body["reason"] = "shutting_down"
        if await _sees_details(request):
            body["models"] = {m.id: m.state for m in registry.models.values()}
            body["errors"] = {m.id: m.problem for m in registry.models.values() if m.problem}
            if peers:
                body["peers"] = {n.name: "up" if n.up else n.problem for n in peers.nodes.values()}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def _sees_details(request: Request) -> bool:
        if keys.empty:
            return keys.open_when_empty
        presented = presented_key(request.headers.raw)
        # /ready is outside the wrong-key limiter: a key whose check would run
        # the slow KDF (an old PBKDF2 record not verified yet) is not checked
        # here, or wrong keys sent here would cost that CPU without limit.
        if presented is None or keys.needs_kdf(presented):
            return False
        principal = await keys.authenticate(presented)
        return principal is not None and principal.admin

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def admin_only() -> None:
        if not current_principal().admin:
            raise APIError(403, "this API key is not an admin key", code="admin_only")

    def model_or_404(model_id: str):
        served = registry.get(model_id)
        if served is None:
            raise APIError(404, f"model '{model_id}' does not exist", code="model_not_found")
        return served

    @app.post("/admin/reload")
    async def reload():
        """Re-read the keys file and the config file (SIGHUP does the same)."""
        admin_only()
        try:
            return await reloader.reload()
        except ReloadRefused as e:
            raise APIError(400, str(e), code=e.code) from None

    @app.get("/admin/models")
    async def list_models_admin():
        """Every configured model with its residency (`specgate models`)."""
        admin_only()
        return {"memory_budget": registry.memory_budget, "models_budget": registry.models_budget,
                "prefix_cache_budget": registry.prefix_cache_budget,
                "models": [model_status(m) for m in registry.models.values()]}  # fmt: skip

    @app.post("/admin/models/{model_id}/unload")
    async def unload_model(model_id: str):
        admin_only()
        served = model_or_404(model_id)
        if served.loading is not None:
            raise APIError(409, f"model '{model_id}' is loading", code="model_busy")
        if served.config.distributed is not None:
            raise APIError(409, f"model '{model_id}' is distributed: its other ranks hold their "
                                "shards until specgate stops", code="model_distributed")  # fmt: skip
        await registry.unload(served)
        return {"id": model_id, "status": "unloaded"}

    @app.post("/admin/models/{model_id}/load")
    async def load_model(model_id: str):
        admin_only()
        served = model_or_404(model_id)
        await registry.ensure_loaded(served)  # 503 with the reason if it cannot
        return {"id": model_id, "status": "ready"}

    # Residency while serving: what the config's `pin` and `idle_ttl_s` say
    # until a restart (or a reload that changes the model), never written.
    def residency_changeable(model_id: str):
        admin_only()
        served = model_or_404(model_id)
        if served.config.distributed is not None:
            raise APIError(409, f"model '{model_id}' is distributed: it stays pinned while "
                                "specgate runs", code="model_distributed")  # fmt: skip
        return served

    @app.post("/admin/models/{model_id}/pin")
    async def pin_model(model_id: str):
        served = residency_changeable(model_id)
        served.pin = True
        return model_status(served)

    @app.post("/admin/models/{model_id}/unpin")
    async def unpin_model(model_id: str):
        served = residency_changeable(model_id)
        served.pin = False
        return model_status(served)

    @app.post("/admin/models/{model_id}/idle_ttl")
    async def set_idle_ttl(model_id: str, request: Request):
        """Body {"idle_ttl_s": seconds > 0, or null: stay loaded}. A pinned
        model keeps it for when it is unpinned."""
        served = residency_changeable(model_id)
        try:
            body = await request.json()
        except ValueError:
            body = None
        ttl = body.get("idle_ttl_s", ...) if isinstance(body, dict) else ...
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                                or not 0 < ttl < float("inf")):  # fmt: skip
            raise APIError(400, 'send {"idle_ttl_s": seconds above 0, or null to stay loaded}',
                           code="invalid_request_error", param="idle_ttl_s")  # fmt: skip
        served.idle_ttl_s = None if ttl is None else float(ttl)
        return model_status(served)

    app.add_middleware(ModelLeases, registry=registry)
    # Inside the body limit and the key check: a relayed body is bounded, its key checked here.
    app.add_middleware(PeerRouter, peers=peers, registry=registry, responses=app.state.responses,
                       metrics=metrics)  # fmt: skip
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes,
                       body_timeout_s=config.server.body_timeout_s,
                       body_deadline_s=config.server.body_deadline_s)
    # Before the body limit: a request without a valid key costs no body read.
    app.add_middleware(AuthMiddleware, keys=keys,
                       metrics_requires_key=config.auth.metrics_requires_key,
                       on_failure=metrics.auth_failed,
                       limiter=FailedAuthLimiter.from_config(config.auth),
                       read_only_paths=frozenset({"/admin/status"} if config.auth.loopback_status
                                                 else ()))  # fmt: skip
    # Outermost: a request the key check refuses is logged too.
    app.add_middleware(AccessLogMiddleware, access_log=access_log)
    return app


def _on_sighup(reloader: Reloader):
    """SIGHUP reloads, as POST /admin/reload; returns the undo. Only where
    the loop runs in the main thread (the server; not an in-process test)."""
    loop = asyncio.get_running_loop()

    async def reload():
        try:
            await reloader.reload()
        except ReloadRefused as e:
            log.error("SIGHUP: %s", e)

    try:
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload()))
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):  # no SIGHUP here
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGHUP)
