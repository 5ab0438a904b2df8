"""The admin page's data (GET /admin/status), and the page itself (GET /).

The page is static (gateway/operator/static/admin.html, no build step, no CDN) and
holds no data: its script asks /admin/status with the key typed into it
(kept in the browser's localStorage), or with none. Everything here is read
from what already exists: the registry's models and their admission
queues, the metrics registry's samples (the same numbers /metrics shows),
the requests decoding now, the access log's last requests, the history
sampler's last hour (history.py), the keys' records and usage, and the
last warnings specgate logged.

Three views, by who asks (`view` in the answer):
- "admin" (an admin key; anyone on an open loopback server): everything;
- "read_only" (a loopback client sending no key to a server with keys,
  auth.loopback_status): everything but the keys and the log lines, and
  the page offers no action;
- "own_key" (any other key): that key's usage, queue places and requests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from importlib.resources import files

from specgate.gateway.access.auth import KeyStore, Principal
from specgate.gateway.operator.history import History
from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.models import ModelRegistry, ServedModel, model_status

# specgate's own loggers (not uvicorn's or httpx's).
OWN_LOGGERS = ("specgate",)


def page() -> bytes:
    return files(__package__).joinpath("static/admin.html").read_bytes()


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


RECENT = 50  # the access log's last requests shown
# The admin page's own loads: not shown among the recent requests (its
# polls of /admin/status never reach them: access/access_log.py's QUIET).
PAGE_READS = frozenset({("GET", "/"), ("GET", "/ui")})


def _key_counts(samples: dict) -> dict[str, dict]:
    """Requests, tokens and refusals per key name, from the metrics."""
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
    return keys


def _keys(keys: KeyStore, counts: dict[str, dict]) -> list[dict]:
    """Every key: name, what it may do, its limits and usage. Never its
    hash or id (the id is half of the key a client sends)."""
    now = time.monotonic()
    out = []
    for record, usage in keys.listing():
        out.append({"name": record.name, "admin": record.admin, "models": record.models,
                    "created": record.created, "limits": {"rpm": record.rpm, "tpm": record.tpm,
                                                          "max_concurrent": record.max_concurrent},
                    "last_minute": usage.in_window(now), **counts.get(record.name, {})})  # fmt: skip
    if keys.empty:  # an open server: everyone is the anonymous key
        usage = keys.anonymous.usage
        out.append({"name": keys.anonymous.name, "admin": True, "models": None, "created": "",
                    "limits": {}, "last_minute": usage.in_window(now),
                    **counts.get(keys.anonymous.name, {})})  # fmt: skip
    return out


def _queue(served: ServedModel, now: float) -> dict:
    gate = served.gate
    return {"model": served.id, "slots": gate.slots, "running": gate.running,
            "max_queue": gate.max_queue, "waiting": gate.waiters(now)}  # fmt: skip


def recent_requests(access_log, key: str | None = None) -> list[dict]:
    """The access log's last requests (newest last), one key's if `key`.
    The log is gateway/access/access_log.py's (app.state.access_log);
    absent, none."""
    entries = [e for e in getattr(access_log, "recent", ())
               if (e.get("method"), e.get("path")) not in PAGE_READS]  # fmt: skip
    if key is not None:
        entries = [e for e in entries if e.get("key") == key]
    return entries[-RECENT:]


def own_status(principal: Principal, registry: ModelRegistry, metrics: Metrics,
               access_log) -> dict:  # fmt: skip
    """What a key that is not an admin's sees: its own usage and limits,
    its places in the models' queues, its last requests."""
    now = time.monotonic()
    name, limits = principal.name, principal.usage.limits
    counts = _key_counts(_samples(metrics)).get(name, {})
    waiting = [w | {"model": m.id} for m in registry.models.values()
               for w in m.gate.waiters(now) if w["key"] == name]  # fmt: skip
    return {"view": "own_key",
            "key": {"name": name, "models": sorted(principal.models) if principal.models is not None
                    else None, "limits": {"rpm": limits.rpm, "tpm": limits.tpm,
                                          "max_concurrent": limits.max_concurrent},
                    "last_minute": principal.usage.in_window(now), **counts},
            "waiting": waiting, "recent": recent_requests(access_log, name)}  # fmt: skip


def read_only(full: dict) -> dict:
    """The admin view less what only an admin sees: the keys (names,
    limits, usage), the log lines, models' load errors and the peers'
    addresses (paths and hosts), as /ready keeps them from non-admins."""
    hidden = ("keys", "key_list", "errors", "peers")
    models = [m | {"error": None} for m in full["models"]]
    return {k: v for k, v in full.items() if k not in hidden} | {"view": "read_only",
                                                               "models": models}


def status(registry: ModelRegistry, metrics: Metrics, errors: RecentErrors, keys: KeyStore,
           access_log, history: History) -> dict:
    """The admin view: everything."""
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

    counts = _key_counts(samples)

    requests = []
    for request_id, live in list(metrics.live.requests.items()):
        age = now - live.started
        requests.append({"id": request_id, "model": live.model, "key": live.key,
                         "method": live.method, "prompt_tokens": live.prompt_tokens,
                         "generated": live.generated, "seconds": round(age, 1),
                         "tokens_per_s": round(live.generated / age, 1) if age > 0 else 0.0})  # fmt: skip

    return {
        "view": "admin",
        "memory_budget": registry.memory_budget,
        "models_budget": registry.models_budget,
        "prefix_cache_budget": registry.prefix_cache_budget,
        "models": [model_status(m) for m in registry.models.values()],
        "requests": requests,
        "plans": plans,
        "acceptance": acceptance,
        # By key name, from the metrics (the anonymous key's too): what the
        # key list (`key_list`) adds its records' limits to.
        "keys": counts,
        "key_list": _keys(keys, counts),
        "queues": [_queue(m, now) for m in registry.models.values()],
        "recent": recent_requests(access_log),
        "history": {"interval_s": history.interval_s, "points": list(history.points)},
        "errors": list(errors.records),
    }
