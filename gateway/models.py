"""The models a gateway serves: loading them, their engines, their policy."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from engines.base import Engine
from gateway.config import BUILTIN_DEMO, Config, ModelConfig
from policies.decide import ModelPolicy

log = logging.getLogger(__name__)

# Used when neither the config nor the checkpoint names a context length.
FALLBACK_MAX_CONTEXT = 4096


@dataclass
class ServedModel:
    config: ModelConfig
    engine: Engine | None = None
    policy: ModelPolicy | None = None
    error: str | None = None
    loaded: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.config.id


def resolve_path(path: str) -> str:
    if path == BUILTIN_DEMO:
        from engines.checkpoints.default_model import default_model_path

        return str(default_model_path())
    return path


def _build_engine(mc: ModelConfig) -> Engine:
    """Blocking: loads weights (once per path) and builds the model's engine."""
    from engines.loading import load_mlx_model
    from engines.mlx_plain import MLXPlainEngine

    loaded = load_mlx_model(resolve_path(mc.path))
    max_context = mc.max_context or loaded.max_position_embeddings or FALLBACK_MAX_CONTEXT
    return MLXPlainEngine(
        mc.id,
        loaded,
        max_context=max_context,
        max_concurrent=mc.max_concurrent,
        max_queue=mc.max_queue,
        prefix_cache_size=mc.prefix_cache_size,
    )


class ModelRegistry:
    def __init__(self, config: Config):
        self.models = {mc.id: ServedModel(mc) for mc in config.models}

    def get(self, model_id: str) -> ServedModel | None:
        return self.models.get(model_id)

    @property
    def ready(self) -> bool:
        return all(m.engine is not None for m in self.models.values())

    async def load_all(self) -> None:
        """Load models one after another (they share one machine's memory)."""
        for served in self.models.values():
            try:
                engine = await asyncio.to_thread(_build_engine, served.config)
                await engine.start()
                served.engine = engine
                served.policy = ModelPolicy(served.id, {"none": engine.name})
                log.info("model %s ready (%s)", served.id, engine.name)
            except Exception as e:  # one bad model must not take down the others
                served.error = f"{type(e).__name__}: {e}"
                log.error("model %s failed to load: %s", served.id, served.error)
            finally:
                served.loaded.set()

    async def stop_all(self) -> None:
        for served in self.models.values():
            if served.engine is not None:
                await served.engine.stop()
