"""specgate under `mlx.launch`: one model over several machines.

Every rank runs `specgate serve --config X` (mlx.launch starts the same
command everywhere). Rank 0 binds the port and serves as always; its
distributed model's engines share their decisions (engines/distributed/lockstep.py).
Every other rank builds the same model's engines on its own shard, starts
them, and follows rank 0 (`follow`) until rank 0 stops; it serves no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import sys
import threading

from specgate.gateway.config import Config, ModelConfig
from specgate.gateway.serving.ranks import distributed_model, process_group

log = logging.getLogger(__name__)


def launched() -> bool:
    """Whether this process was started by mlx.launch (it sets MLX_RANK)."""
    return "MLX_RANK" in os.environ


def launch_command(mc: ModelConfig, config_path: str | None) -> str:
    """What to run instead of a plain `specgate serve` (for the error that says so)."""
    d = mc.distributed
    hosts = f"--hostfile {shlex.quote(d.hostfile)}" if d.hostfile else "--hostfile hosts.json"
    config = f" --config {shlex.quote(config_path)}" if config_path else ""
    return (f"mlx.launch {hosts} --backend {d.backend} -- "
            f"{shlex.quote(sys.executable)} -m specgate.gateway.operator.cli serve{config}")  # fmt: skip


def follow(config: Config) -> int:
    """Another rank: build the distributed model's engines as rank 0 does,
    then run the steps rank 0 names until it stops. Exit status 0 when rank
    0 stopped, 1 when it is gone (mlx.launch then stops every rank)."""
    from specgate.engines.distributed.lockstep import LockstepBroken
    from specgate.gateway.serving.models import build_model_engines

    mc = distributed_model(config)
    me = process_group(mc.distributed.backend).rank()
    log.info("rank %d: loading %s (%s parallel)", me, mc.id, mc.distributed.mode)
    prefix_cache = config.prefix_cache.model_copy(update={"ram_bytes": config.budgets().prefix_cache})
    context, engines, refused = build_model_engines(mc, config.llama_server, prefix_cache)
    for name, why in refused.items():
        log.warning("rank %d: %s not built: %s", me, name, why)
    lockstep = context.loaded.lockstep
    _outlive_signals(me)
    asyncio.run(_each(engines, "start"))
    log.info("rank %d: following rank 0 with %s", me, ", ".join(engines))

    def alive(name: str) -> bool:
        return any(t.name == name and t.is_alive() for t in threading.enumerate())

    try:
        lockstep.follow(alive)
        log.info("rank %d: rank 0 stopped", me)
        return 0
    except LockstepBroken as e:
        log.error("rank %d: %s", me, e)
        return 1
    finally:
        asyncio.run(_each(engines, "stop"))


def end_drained_with_success() -> None:
    """Rank 0: uvicorn, stopped by a signal, drains and then raises the
    signal again through the handler it found, so the process ends as
    signalled. Under mlx.launch that reads as a failed rank, and it kills
    the other ranks, which were about to end on rank 0's stop. The handler
    found is this one: it ends the process with status 0."""

    def on_signal(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


FOLLOWER_GRACE_S = 60.0  # after a SIGTERM, how long another rank waits for rank 0's stop


def _outlive_signals(me: int) -> None:
    """mlx.launch, a service manager or a terminal signals every rank at
    once. Rank 0 then drains its requests, which needs this rank, and sends
    the stop; so a SIGTERM or SIGINT here waits for that, up to a grace
    (then, or at a second signal, this rank exits)."""
    signalled = threading.Event()

    def on_signal(signum, frame):
        if signalled.is_set():
            os._exit(128 + signum)
        signalled.set()
        log.info("rank %d: %s: waiting up to %g s for rank 0 to stop", me,
                 signal.Signals(signum).name, FOLLOWER_GRACE_S)  # fmt: skip
        timer = threading.Timer(FOLLOWER_GRACE_S, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


async def _each(engines: dict, method: str) -> None:
    for engine in engines.values():
        await getattr(engine, method)()
