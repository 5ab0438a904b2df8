"""This process's place among the ranks `mlx.launch` started (gateway/cluster/distributed.py)."""

from __future__ import annotations

from functools import cache

from specgate.gateway.config import Config, ModelConfig


def distributed_model(config: Config) -> ModelConfig | None:
    return next((m for m in config.models if m.distributed is not None), None)


@cache
def process_group(backend: str):
    """This process's mx.distributed group (one per process, made once)."""
    import mlx.core as mx

    return mx.distributed.init(strict=True, backend=backend)


def rank(config: Config) -> int:
    """This process's rank (0 without a distributed model)."""
    mc = distributed_model(config)
    return 0 if mc is None else process_group(mc.distributed.backend).rank()


def distribution(mc: ModelConfig):
    """The model's engines/distributed/lockstep.Distribution, or None."""
    if mc.distributed is None:
        return None
    from specgate.engines.distributed.lockstep import Distribution

    d = mc.distributed
    return Distribution(d.mode, process_group(d.backend), d.rank_timeout_s)
