"""The FastAPI app: wiring of routes, limits, errors and model lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from gateway.anthropic_api import router as anthropic_router
from gateway.config import Config
from gateway.errors import install_error_handlers
from gateway.limits import BodyLimitMiddleware
from gateway.metrics import Metrics
from gateway.models import ModelRegistry
from gateway.openai_api import router as openai_router

log = logging.getLogger(__name__)


def create_app(config: Config) -> FastAPI:
    registry = ModelRegistry(config)

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
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        models = {
            m.id: ("ready" if m.engine else "failed" if m.error else "loading")
            for m in registry.models.values()
        }
        errors = {m.id: m.error for m in registry.models.values() if m.error}
        ok = registry.ready
        return JSONResponse(
            {"status": "ready" if ok else "not_ready", "models": models, "errors": errors},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes)
    return app
