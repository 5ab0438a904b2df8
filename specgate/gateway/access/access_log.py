"""One access line per HTTP request, and the last ones for the admin page.

`AccessLogMiddleware` is plain ASGI (a stream passes through unbuffered)
and the outermost of the app's middlewares, so a request the key check
refuses (401, 429) is logged too. It writes one line on logger
`specgate.access` when the response has ended: its last byte sent, an
error, or the client gone mid-stream. Scrapes and health checks
(`QUIET`) go at DEBUG, everything else at INFO.

Meanwhile an `AccessRecord` is held in a context variable: serving/generation.py
fills it (the model, its plans, tokens and their times; several
generations of one request, Ollama's or n > 1, add up), and the request's
id is the first generation's request_id and the response's `X-Request-Id`,
so a client's error can be found in the log.

Fields, in this order (`FIELDS`): time, id, client, key (the key's name
from the keys file, "anonymous" on an open server, "-" where no key was
checked or it was refused), method, path, api, model, node (the peer that
served it, for a request relayed by gateway/cluster/proxy.py; its own log has the
decoding's details under X-Specgate-Peer-Request-Id), plan (its methods in
order: `ngram>none` when a stream switched), prompt_tokens, cached_tokens,
completion_tokens, ttft_s (from the request's arrival), decode_tok_s (the
tokens after the first over the time after it; none under 2 tokens),
duration_s, status (HTTP; none when no response started) and outcome: ok,
error, rejected (a 4xx) or cancelled (the client left before the end). A
200 stream that failed past its first byte is `outcome=error`.

A text line is `key=value` pairs (a value with spaces or quotes quoted as
JSON); `JsonFormatter` makes every log line a JSON object, an access
line's fields as its keys (`server.log_format: json`, `--log-format json`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from specgate.gateway.access.auth import authenticated

log = logging.getLogger("specgate.access")

REQUEST_ID_HEADER = "X-Request-Id"
PEER_REQUEST_ID = b"x-specgate-peer-request-id"
RECENT = 200  # access records kept for the admin page
FIELDS = ("time", "id", "client", "key", "method", "path", "api", "model", "node", "plan",
          "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "decode_tok_s",
          "duration_s", "status", "outcome")  # fmt: skip
# Polled by Prometheus, load balancers, Ollama's clients and the admin page
# (every 2 s while open): DEBUG, and not among the recent requests.
QUIET = frozenset({("GET", "/metrics"), ("GET", "/health"), ("GET", "/ready"), ("HEAD", "/"),
                   ("GET", "/admin/status")})


def utc_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def api_of(path: str) -> str:
    """Which API a path belongs to, by the routes' prefixes."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/responses"):
        return "responses"
    if path == "/v1" or path.startswith("/v1/"):
        return "openai"
    if path.startswith("/api/"):
        return "ollama"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    if path == "/metrics":
        return "metrics"
    if path in ("/health", "/ready"):
        return "health"
    if path in ("/", "/ui"):
        return "ui"
    return "-"


@dataclass
class AccessRecord:
    """What one request did, filled while it runs (serving/generation.py)."""

    id: str
    started: float  # time.perf_counter() at its arrival
    key: str | None = None
    model: str | None = None
    node: str | None = None  # the peer that served it (gateway/cluster/proxy.py)
    plans: list[str] = field(default_factory=list)
    generations: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    first_tokens: int = 0  # those that came with the first
    last_token_at: float | None = None
    failed: str | None = None  # a generation's "error" or "rejected"

    def note_key(self) -> None:
        """The key's name, once the key check has let the request in (its
        context variable is set where the app runs, not here)."""
        if self.key is None and (principal := authenticated()) is not None:
            self.key = principal.name

    def generation_id(self) -> str:
        """An engine's request id for this request's next generation: the
        request's own id first (as in the log), then `<id>-2`, `<id>-3`."""
        self.generations += 1
        return self.id if self.generations == 1 else f"{self.id}-{self.generations}"

    def planned(self, method: str) -> None:
        if not self.plans or self.plans[-1] != method:
            self.plans.append(method)

    def tokens(self, count: int, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at, self.first_tokens = now, count
        self.last_token_at = now
        self.completion_tokens += count

    def relayed(self, node: str, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A peer served it: its model and the tokens its usage said."""
        self.node, self.model = node, model
        self.generations += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def generation_ended(self, status: str) -> None:
        """A generation's status (metrics' ok/error/rejected/cancelled). A
        cancelled one is not the client's leaving (the HTTP side sees
        that) but an adapter done with it; an error outweighs a refusal."""
        if status == "error" or (status == "rejected" and self.failed is None):
            self.failed = status

    def fields(self, scope, status: int | None, outcome: str, now: float) -> dict:
        client = scope.get("client")
        spoke = self.first_token_at is not None
        after_first = self.completion_tokens - self.first_tokens
        span = (self.last_token_at - self.first_token_at) if spoke else 0.0
        ran = self.generations > 0
        return {
            "time": utc_iso(time.time()),
            "id": self.id,
            "client": client[0] if client else "-",
            "key": self.key or "-",
            "method": scope["method"],
            "path": scope["path"],
            "api": api_of(scope["path"]),
            "model": self.model,
            "node": self.node,
            "plan": ">".join(self.plans) or None,
            "prompt_tokens": self.prompt_tokens if ran else None,
            "cached_tokens": self.cached_tokens if ran else None,
            "completion_tokens": self.completion_tokens if ran else None,
            "ttft_s": round(self.first_token_at - self.started, 3) if spoke else None,
            "decode_tok_s": (round(after_first / span, 1)
                             if self.completion_tokens >= 2 and after_first and span > 0 else None),
            "duration_s": round(now - self.started, 3),
            "status": status,
            "outcome": outcome,
        }


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar(
    "specgate_access_record", default=None)  # fmt: skip


def current() -> AccessRecord | None:
    """The record of the request being served (None outside the middleware)."""
    return _current.get()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


_BARE = re.compile(r"[\w./:@>+,\-]+")


def text(fields: dict) -> str:
    """`key=value` pairs in FIELDS' order, none for a missing value."""
    return " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None and k != "time")


def _value(v) -> str:
    s = str(v)
    return s if _BARE.fullmatch(s) else json.dumps(s)


class AccessLog:
    """Where access records go: the log, and `recent` (newest last; scrapes
    and health checks left out), which the admin page shows."""

    def __init__(self, keep: int = RECENT):
        self.recent: deque[dict] = deque(maxlen=keep)

    def write(self, fields: dict) -> None:
        quiet = (fields["method"], fields["path"]) in QUIET
        if not quiet:
            self.recent.append(fields)
        level = logging.DEBUG if quiet else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "%s", text(fields), extra={"access": fields})


class AccessLogMiddleware:
    def __init__(self, app, access_log: AccessLog):
        self.app, self.access_log = app, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord(new_request_id(), time.perf_counter())
        header = (REQUEST_ID_HEADER.lower().encode(), record.id.encode())
        status: int | None = None
        ended = left = False

        async def receiving():
            nonlocal left
            message = await receive()
            # uvicorn answers http.disconnect after a response's end too.
            left = left or (message["type"] == "http.disconnect" and not ended)
            record.note_key()
            return message

        async def sending(message):
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                # A peer's own id (gateway/cluster/proxy.py relays it) goes on under another name.
                relayed = [(PEER_REQUEST_ID, v) if k.lower() == header[0] else (k, v)
                           for k, v in message.get("headers", ())]  # fmt: skip
                message = message | {"headers": [*relayed, header]}
                record.note_key()
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True  # first: a disconnect seen during this last send is no leaving
            await send(message)

        token = _current.set(record)
        outcome = None
        try:
            await self.app(scope, receiving, sending)
        except asyncio.CancelledError:  # the server's shutdown
            outcome = "cancelled"
            raise
        except BaseException:
            outcome = "error"
            status = status or 500  # what Starlette's ServerErrorMiddleware sends
            raise
        finally:
            _current.reset(token)
            if left or (outcome is None and not ended):
                outcome = "cancelled"
            elif outcome is None and status >= 400:
                outcome = "error" if status >= 500 else "rejected"
            elif outcome is None:  # a stream's error past its start is an event in a 200
                outcome = record.failed or "ok"
            self.access_log.write(record.fields(scope, status, outcome, time.perf_counter()))


class JsonFormatter(logging.Formatter):
    """Every log line as one JSON object: time (UTC, ISO 8601), level,
    logger and message; an access line's fields as keys instead of a
    message. `static`: keys every line carries (a distributed rank's)."""

    def __init__(self, static: dict | None = None):
        super().__init__()
        self.static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": utc_iso(record.created), "level": record.levelname,
                "logger": record.name, **self.static}  # fmt: skip
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            line |= access
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)
