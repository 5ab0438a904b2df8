"""The admin page's last hour: tokens generated per second and memory, one
point every INTERVAL_S (a task the app's lifespan starts), POINTS kept.

Read from what exists: the metrics registry's generated-token counter
(the same number /metrics shows), the gateway process's resident size
(engines/memory.py) and what the models hold (ServedModel.memory, their
llama-servers included).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

from specgate.engines.memory import process_rss
from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.models import ModelRegistry

log = logging.getLogger(__name__)

INTERVAL_S = 15.0
POINTS = 240  # an hour


def generated_tokens(metrics: Metrics) -> float:
    """Tokens generated since start, every model and method together."""
    return sum(s.value for family in metrics.generation_tokens.collect()
               for s in family.samples if s.name.endswith("_total"))  # fmt: skip


class History:
    def __init__(self, registry: ModelRegistry, metrics: Metrics,
                 interval_s: float = INTERVAL_S, points: int = POINTS):  # fmt: skip
        self.registry, self.metrics, self.interval_s = registry, metrics, interval_s
        self.points: deque[dict] = deque(maxlen=points)
        self._last: tuple[float, float] | None = None  # (monotonic time, tokens) of the last point

    async def sample(self) -> None:
        now, tokens = time.monotonic(), generated_tokens(self.metrics)
        rate = None
        if self._last is not None and now > self._last[0]:
            rate = round((tokens - self._last[1]) / (now - self._last[0]), 2)
        self._last = (now, tokens)
        # Off the loop: on macOS process_rss runs `ps`.
        rss = await asyncio.to_thread(process_rss, os.getpid())
        models = sum(sum(m.memory().values()) for m in self.registry.models.values())
        self.points.append({"time": round(time.time(), 1), "tokens_per_s": rate,
                            "rss": rss, "models": models})  # fmt: skip

    async def run(self) -> None:
        """Sample now and every interval until cancelled; a failed sample is
        logged and the next one still taken."""
        while True:
            try:
                await self.sample()
            except Exception:
                log.exception("admin page history: a sample failed")
            await asyncio.sleep(self.interval_s)
