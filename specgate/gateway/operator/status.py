"""The status page's data (GET /admin/status), and the page itself (GET /).

The page is static (gateway/operator/static/status.html, no build step, no CDN) and
holds no data: its script asks /admin/status with the admin key typed into
it (kept in the browser's localStorage), or with none on an open loopback
server. Everything here is read from what already exists: the registry's
models, the metrics registry's samples (the same numbers /metrics shows),
the requests decoding now, and the last warnings specgate logged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from importlib.resources import files

from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.models import ModelRegistry, model_status

# specgate's own loggers (not uvicorn's or httpx's).
OWN_LOGGERS = ("specgate",)


def page() -> bytes:
    return files(__package__).joinpath("static/status.html").read_bytes()


class RecentErrors(logging.Handler):
    """The last warnings and errors specgate logged, newest last."""

    def __init__(self, size: int = 50):
        super().__init__(logging.WARNING)
        self.records: deque[dict] = deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in a log call: still say something
            message = str(record.msg)
        self.records.append({"time": record.created, "level": record.levelname,
                             "logger": record.name, "message": message[:2000]})  # fmt: skip

    def attach(self) -> None:
        for name in OWN_LOGGERS:
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in OWN_LOGGERS:
            logging.getLogger(name).removeHandler(self)


def _samples(metrics: Metrics) -> dict[str, list[tuple[dict, float]]]:
    """Every sample in the metrics registry, by sample name."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def status(registry: ModelRegistry, metrics: Metrics, errors: RecentErrors) -> dict:
    now = time.monotonic()
    samples = _samples(metrics)

    plans: dict[str, list[dict]] = {}
    for labels, n in samples.get("specgate_plan_decisions_total", []):
        plans.setdefault(labels["model"], []).append(
            {"method": labels["method"], "reason": labels["reason"], "source": labels["source"],
             "count": int(n)})  # fmt: skip
    for rows in plans.values():
        rows.sort(key=lambda r: -r["count"])

    acceptance: dict[str, dict[str, dict]] = {}
    for name, field in (("specgate_spec_decode_acceptance_rate", "rate"),
                        ("specgate_spec_decode_mean_acceptance_length", "mean_length")):  # fmt: skip
        for labels, v in samples.get(name, []):
            acceptance.setdefault(labels["model"], {}).setdefault(labels["method"], {})[field] = v
    # The policy's live estimate per draft position, by content (code, prose).
    for labels, v in samples.get("specgate_policy_acceptance_rate", []):
        entry = acceptance.setdefault(labels["model"], {}).setdefault(labels["method"], {})
        per = entry.setdefault("by_position", {}).setdefault(labels["content"], [])
        pos = int(labels["position"])
        per.extend([None] * (pos + 1 - len(per)))
        per[pos] = round(v, 3)

    keys: dict[str, dict] = {}
    for name, field in (("specgate_key_prompt_tokens_total", "prompt_tokens"),
                        ("specgate_key_generation_tokens_total", "generated_tokens")):  # fmt: skip
        for labels, v in samples.get(name, []):
            keys.setdefault(labels["key"], {})[field] = int(v)
    for labels, v in samples.get("specgate_key_requests_total", []):
        entry = keys.setdefault(labels["key"], {}).setdefault("requests", {})
        entry[labels["status"]] = int(v)
    for labels, v in samples.get("specgate_key_rejected_requests_total", []):
        entry = keys.setdefault(labels["key"], {}).setdefault("rejected", {})
        entry[labels["reason"]] = int(v)

    requests = []
    for request_id, live in list(metrics.live.requests.items()):
        age = now - live.started
        requests.append({"id": request_id, "model": live.model, "key": live.key,
                         "method": live.method, "prompt_tokens": live.prompt_tokens,
                         "generated": live.generated, "seconds": round(age, 1),
                         "tokens_per_s": round(live.generated / age, 1) if age > 0 else 0.0})  # fmt: skip

    return {
        "memory_budget": registry.memory_budget,
        "models_budget": registry.models_budget,
        "prefix_cache_budget": registry.prefix_cache_budget,
        "models": [model_status(m) for m in registry.models.values()],
        "requests": requests,
        "plans": plans,
        "acceptance": acceptance,
        "keys": keys,
        "errors": list(errors.records),
    }
