"""The FastAPI app: wiring of routes, keys, limits, errors and model lifecycle.

Admin routes (an admin key; any caller on an open loopback server):
`POST /admin/reload` re-reads the keys file (the model config is not
reloaded: restart for that), `POST /admin/models/{id}/unload` and
`.../load` stop a model's engines to free its memory and bring it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from gateway import openai_api
from gateway.anthropic_api import router as anthropic_router
from gateway.auth import (
    AuthMiddleware,
    FailedAuthLimiter,
    KeyStore,
    current_principal,
    is_loopback,
    presented_key,
)
from gateway.config import Config
from gateway.errors import APIError, install_error_handlers
from gateway.keys import KeyFileError
from gateway.limits import BodyLimitMiddleware
from gateway.metrics import Metrics
from gateway.models import ModelRegistry

log = logging.getLogger(__name__)


def create_app(config: Config) -> FastAPI:
    """KeyFileError if the keys file cannot be used."""
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
        loading = asyncio.create_task(registry.load_all())
        try:
            yield
        finally:
            loading.cancel()
            await registry.stop_all()

    app = FastAPI(title="specgate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.registry = registry
    app.state.started_at = int(time.time())
    app.state.metrics = metrics = Metrics(registry)
    app.state.keys = keys
    install_error_handlers(app)

    # Before the OpenAI router's own /v1/models, which lists every model:
    # a key sees only the models it may use.
    @app.get("/v1/models")
    async def list_models(request: Request):
        listing = await openai_api.list_models(request)
        principal = current_principal()
        listing["data"] = [m for m in listing["data"] if principal.may_use(m["id"])]
        return listing

    app.include_router(openai_api.router)
    app.include_router(anthropic_router)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        """Open to anyone (load balancers, probes): ready or not. Each model's
        state and errors (file paths, engine problems) only for an admin key,
        or anyone on an open loopback server."""
        ok = registry.ready and not registry.draining
        body: dict = {"status": "ready" if ok else "not_ready"}
        if registry.draining:
            body["reason"] = "shutting_down"
        if await _sees_details(request):
            body["models"] = {m.id: m.state for m in registry.models.values()}
            body["errors"] = {m.id: m.problem for m in registry.models.values() if m.problem}
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
        if not served.loaded.is_set():
            raise APIError(409, f"model '{model_id}' is loading", code="model_busy")
        return served

    @app.post("/admin/reload")
    async def reload_keys():
        admin_only()
        try:
            count = keys.reload()
        except KeyFileError as e:
            raise APIError(400, f"keys not reloaded, the old ones stay: {e}",
                           code="bad_keys_file") from None
        log.info("reloaded %d API keys from %s", count, keys.path)
        return {"keys": count, "names": keys.names}

    @app.post("/admin/models/{model_id}/unload")
    async def unload_model(model_id: str):
        admin_only()
        served = model_or_404(model_id)
        if not served.unloaded:
            await registry.unload(served)
        return {"id": model_id, "status": "unloaded"}

    @app.post("/admin/models/{model_id}/load")
    async def load_model(model_id: str):
        admin_only()
        served = model_or_404(model_id)
        if served.engine is None:
            await registry.load(served)
        if served.error:
            raise APIError(500, f"model '{model_id}' failed to load: {served.error}")
        return {"id": model_id, "status": "ready"}

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes,
                       body_timeout_s=config.server.body_timeout_s)
    # Outermost: a request without a valid key costs no body read.
    app.add_middleware(AuthMiddleware, keys=keys,
                       metrics_requires_key=config.auth.metrics_requires_key,
                       on_failure=metrics.auth_failed,
                       limiter=FailedAuthLimiter.from_config(config.auth))
    return app
