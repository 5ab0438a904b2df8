"""Requests for a model another node serves: routed and relayed (plain ASGI).

`PeerRouter` sits inside the body limit and the key check, so the body it
reads is bounded and the client's key is checked here, with its model list
and quotas; clients' keys never travel on. For the generation routes it
reads the body's `model`, asks gateway/cluster/peers.py which node should serve
it, and either passes the request on to this node's own routes or relays
it to a peer under that peer's node key. The answer comes back as the peer
sent it (tagged `X-Specgate-Node`), streamed event by event, except that:

- a peer is no more trusted than a client: a whole answer is read up to
  64 MiB, an SSE event up to 1 MiB (past either, the peer failed); only the
  headers listed in `_PASSED_ON` (and specgate's own) are passed on, never
  its cookies or hop-by-hop headers; an answer that is not the API's (an
  HTML error page, JSON that is no API error) becomes an error in the API's
  own shape, its status kept when it is a 4xx or 5xx, else 502;
- a peer that cannot be reached before anything was sent is marked down
  and the next node in line is tried, this one included;
- a peer shutting down (its 503 says so) is passed over the same way;
- a peer that fails mid-stream ends the stream with an error event in the
  API's own shape (then `[DONE]` for OpenAI), never a cut-off event;
- an OpenAI stream is asked for its usage (`stream_options.include_usage`)
  to count the key's tokens, and that chunk is dropped again when the
  client did not ask for it.

A Responses API continuation (`previous_response_id`) goes to the node
that holds the response it continues, and only for the key that made it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass

import httpx

from specgate.gateway.access import access_log
from specgate.gateway.access.auth import Principal, client_of, current_principal
from specgate.gateway.access.limits import replay as body_once
from specgate.gateway.access.quotas import Rejected
from specgate.gateway.api.responses_api import ResponseStore
from specgate.gateway.cluster.peers import (
    IDENTITY,
    SERVING_STATES,
    Candidate,
    PeerNode,
    Peers,
    TooLarge,
    choose,
    describe,
    fraction,
    read_capped,
)
from specgate.gateway.config import LOCAL_NODE
from specgate.gateway.errors import error_response
from specgate.gateway.serving.generation import DRAINING_HEADER
from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.models import ModelRegistry

log = logging.getLogger(__name__)

PROXIED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                           "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings",
                           "/v1/rerank"})  # fmt: skip
NODE_HEADER = b"x-specgate-node"
# Request headers that are the hop's own, or the client's credentials.
_DROP_REQUEST = frozenset({b"host", b"content-length", b"authorization", b"x-api-key", b"cookie",
                           b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                           b"upgrade", b"proxy-authorization", b"proxy-connection", b"expect",
                           b"accept-encoding", b"x-forwarded-for"})  # fmt: skip
# A peer's response headers that its client gets. An allow-list, not a
# deny-list: whatever answers at a peer's address (a specgate, or a reverse
# proxy or captive portal in between) may send any header, and one not
# thought of here (Set-Cookie, Alt-Svc, Strict-Transport-Security,
# Location...) would reach clients as this node's own word. The body's type
# and framing, Server, Date and the hop-by-hop headers are this node's to set.
_PASSED_ON = frozenset({b"retry-after", b"cache-control", b"x-accel-buffering", b"x-request-id",
                        b"request-id"})  # fmt: skip
_SPECGATE_PREFIX = b"x-specgate-"  # the peer's own (X-Specgate-Plan...), but for NODE_HEADER
MAX_WHOLE_RESPONSE = 64 << 20  # a whole (not streamed) answer held at most
MAX_EVENT = 1 << 20  # one SSE event held at most (a whole answer's worth of text is far less)
AFFINITY_SIZE = 65536  # response ids remembered for previous_response_id


@dataclass(frozen=True)
class Asked:
    """What routing reads of a body."""

    model: str
    stream: bool
    previous_response_id: str | None
    body: dict


def peek(raw: bytes) -> Asked | None:
    """The body's model and the rest routing needs; None when the body is
    not a JSON object naming a model (this node's routes then answer it)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return None
    previous = body.get("previous_response_id")
    return Asked(body["model"], body.get("stream") is True,
                 previous if isinstance(previous, str) else None, body)  # fmt: skip


def api_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "responses" if path == "/v1/responses" else "openai"


def _usage(obj: object) -> tuple[int, int] | None:
    """(prompt, completion) tokens from a usage object of any of the three APIs."""
    if not isinstance(obj, dict):
        return None
    prompt = obj.get("prompt_tokens", obj.get("input_tokens"))
    completion = obj.get("completion_tokens", obj.get("output_tokens"))
    ok = lambda v: isinstance(v, int) and v >= 0  # noqa: E731
    return (prompt if ok(prompt) else 0, completion if ok(completion) else 0)


class Relayed:
    """What a peer's answer said, read as it passes: tokens used, the
    response id (Responses API), whether it ended properly, and the events
    to drop (the usage chunk asked for on the client's behalf)."""

    def __init__(self, api: str, drop_usage_chunk: bool = False):
        self.api, self.drop_usage_chunk = api, drop_usage_chunk
        self.prompt_tokens = self.completion_tokens = 0
        self.response_id: str | None = None
        self.sequence = 0  # the Responses API's next sequence_number
        self.ended = False  # its final event arrived (or an error event)

    def _saw_usage(self, usage: object, *, prompt: bool = True, completion: bool = True) -> None:
        counted = _usage(usage)
        if counted is None:
            return
        if prompt and counted[0]:
            self.prompt_tokens = counted[0]
        if completion and counted[1]:
            self.completion_tokens = counted[1]

    def whole(self, obj: object) -> None:
        if isinstance(obj, dict):
            self._saw_usage(obj.get("usage"))
            if self.api == "responses" and isinstance(obj.get("id"), str):
                self.response_id = obj["id"]

    def keep(self, event: bytes) -> bool:
        """Read one SSE event; False to drop it."""
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                          if line.startswith(b"data:"))  # fmt: skip
        if data == b"[DONE]":
            self.ended = True
            return True
        try:
            obj = json.loads(data) if data else None
        except ValueError:
            return True
        if not isinstance(obj, dict):
            return True
        if self.api == "openai":
            if "error" in obj:
                self.ended = True
            if isinstance(obj.get("usage"), dict):
                self._saw_usage(obj["usage"])
                if self.drop_usage_chunk and obj.get("choices") == []:
                    return False
            return True
        kind = obj.get("type")
        if self.api == "anthropic":
            if kind == "message_start" and isinstance(obj.get("message"), dict):
                self._saw_usage(obj["message"].get("usage"), completion=False)
            elif kind == "message_delta":
                self._saw_usage(obj.get("usage"), prompt=False)
            self.ended = self.ended or kind in ("message_stop", "error")
            return True
        if isinstance(obj.get("sequence_number"), int):
            self.sequence = obj["sequence_number"] + 1
        response = obj.get("response")
        if kind == "response.created" and isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            if isinstance(response, dict):
                self._saw_usage(response.get("usage"))
            self.ended = True
        self.ended = self.ended or kind == "error"
        return True

    def error_event(self, message: str) -> bytes:
        """The event that ends a stream the peer cut short, in the API's shape."""
        if self.api == "anthropic":
            body = {"type": "error", "error": {"type": "api_error", "message": message}}
            return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
        if self.api == "responses":
            body = {"type": "error", "code": "peer_failed", "message": message, "param": None,
                    "sequence_number": self.sequence}  # fmt: skip
            return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
        body = {"error": {"message": message, "type": "server_error", "param": None,
                          "code": "peer_failed"}}  # fmt: skip
        return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class PeerRouter:
    def __init__(self, app, peers: Peers, registry: ModelRegistry, responses: ResponseStore,
                 metrics: Metrics):  # fmt: skip
        self.app, self.peers, self.registry = app, peers, registry
        self.responses, self.metrics = responses, metrics
        # response id -> (node, key name) of responses made on a peer.
        self._affinity: OrderedDict[str, tuple[str, str]] = OrderedDict()

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in PROXIED_PATHS or not self.peers):  # fmt: skip
            return await self.app(scope, receive, send)
        raw = await _whole_body(receive)
        if raw is None:  # the client left
            return
        replay = body_once(raw, receive)
        asked = peek(raw)
        principal = current_principal()
        try:
            order = self._route(scope["path"], asked, principal) if asked is not None else []
        except _Unavailable as e:
            response = error_response(scope["path"], 503, str(e), code="peer_unavailable",
                                      headers={"Retry-After": "5"})  # fmt: skip
            return await response(scope, receive, send)
        if order and order[0] != LOCAL_NODE:
            done = await self._relay(scope, receive, send, asked, principal, order)
            if done:
                return
        if order:  # a model this node serves, chosen (or the fallback) among nodes
            self.metrics.routed(LOCAL_NODE, asked.model)
        await self.app(scope, replay, _tagged(send, LOCAL_NODE))

    def _route(self, path: str, asked: Asked, principal: Principal) -> list[str]:
        """The nodes to try, in order; [] when this node answers (its own
        model, a model nobody serves, a key that may not use it)."""
        if not principal.may_use(asked.model):
            return []  # this node's 403
        if path == "/v1/responses" and asked.previous_response_id:
            if self.responses.holds(principal.name, asked.previous_response_id):
                return []
            held = self._affinity.get(asked.previous_response_id)
            if held is None or held[1] != principal.name:
                return []  # this node's 404: the response is unknown (to this key)
            return [held[0]]
        peers = self.peers.serving(asked.model)
        served = self.registry.get(asked.model)
        candidates = []
        if served is not None and (served.state in SERVING_STATES or not peers):
            gate = served.gate
            candidates.append(Candidate(LOCAL_NODE, fraction(gate.running, gate.waiting,
                                                             served.config.max_concurrent)))  # fmt: skip
        candidates += [Candidate(n.name, n.load(asked.model)) for n in peers if n.up]
        if not candidates:
            known = [n for n in self.peers.nodes.values() if asked.model in n.models]
            if not known:
                return []  # this node's 404
            raise _Unavailable(f"model '{asked.model}' is served by "
                               + "; ".join(f"{n.name}, down now ({n.problem})" if not n.up
                                           else f"{n.name}, where it is {n.models[asked.model].state}"
                                           for n in known))  # fmt: skip
        return [c.node for c in choose(candidates)]

    async def _relay(self, scope, receive, send, asked: Asked, principal: Principal,
                     order: list[str]) -> bool:  # fmt: skip
        """Serve the request from the first peer in `order` that can be
        reached; False when none could before LOCAL_NODE in the order (this
        node answers then). Counts the key's quota as a local request would."""
        path, key, now = scope["path"], principal.name, time.monotonic()
        try:
            principal.usage.check(now)
        except Rejected as e:
            self.metrics.rejected(key, e.reason)
            response = error_response(path, 429, e.message, code="rate_limit_exceeded",
                                      headers={"Retry-After": e.retry_after_header})  # fmt: skip
            await response(scope, receive, send)
            return True
        principal.usage.start(now)
        relay = asyncio.ensure_future(self._try_in_order(scope, send, asked, principal, order))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():  # the client left: the peer's connection is closed
                relay.cancel()
            try:
                return await relay
            except asyncio.CancelledError:
                if not gone.done():
                    raise  # this request is being cancelled, not one the client left
                return True
        finally:
            relay.cancel()
            gone.cancel()
            principal.usage.finish()

    async def _try_in_order(self, scope, send, asked: Asked, principal: Principal,
                            order: list[str]) -> bool:  # fmt: skip
        path = scope["path"]
        body, drop_usage = asked.body, False
        if api_of(path) == "openai" and asked.stream:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                body = body | {"stream_options": (options if isinstance(options, dict) else {})
                               | {"include_usage": True}}  # fmt: skip
                drop_usage = True
        content = json.dumps(body).encode()
        unreachable = []
        for name in order:
            if name == LOCAL_NODE:
                return False
            node = self.peers.nodes[name]
            node.inflight[asked.model] += 1
            try:
                outcome = await self._one(scope, send, node, asked, principal, content, drop_usage)
            finally:
                node.inflight[asked.model] -= 1
            if outcome is not None:
                unreachable.append(f"{name}: {outcome}")
                continue
            return True
        response = error_response(path, 503, f"no node serving model '{asked.model}' could take "
                                  f"the request: {'; '.join(unreachable)}", code="peer_unavailable",
                                  headers={"Retry-After": "5"})  # fmt: skip
        await response(scope, None, send)
        return True

    async def _one(self, scope, send, node: PeerNode, asked: Asked, principal: Principal,
                   content: bytes, drop_usage: bool) -> str | None:  # fmt: skip
        """Serve the request from `node`; why not if it could not be reached
        (or was shutting down) before anything was sent, else None."""
        c, path, model = node.config, scope["path"], asked.model
        started = time.monotonic()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROP_REQUEST]
        headers += [(k.lower().encode(), v.encode())
                    for k, v in (node.headers() | IDENTITY).items()]  # fmt: skip
        headers.append((b"x-forwarded-for", client_of(scope).encode()))
        query = scope.get("query_string", b"").decode("latin-1")
        request = self.peers.client.build_request(
            "POST", c.base_url + path + (f"?{query}" if query else ""), content=content,
            headers=headers, timeout=httpx.Timeout(c.read_timeout_s, connect=c.connect_timeout_s))
        outcome = "cancelled"
        try:
            try:
                upstream = await self.peers.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing reached it
                node.mark_down(f"{c.base_url} unreachable: {describe(e)}")
                outcome = "unreachable"
                return describe(e)
            except httpx.HTTPError as e:
                node.mark_down(f"{c.base_url} failed a request: {describe(e)}")
                outcome = "failed"
                response = error_response(path, 502, f"peer {node.name} failed before answering: "
                                          f"{describe(e)}", code="peer_failed")  # fmt: skip
                await response(scope, None, send)
                return None
            async with aclosing(upstream):
                if upstream.status_code == 503 and upstream.headers.get(DRAINING_HEADER):
                    node.mark_down(f"{c.base_url} is shutting down")
                    outcome = "unreachable"
                    return "shutting down"
                relayed = Relayed(api_of(path), drop_usage)
                outcome = await self._pass_back(path, send, node, upstream, relayed)
            self._account(principal, relayed, outcome)
            if (record := access_log.current()) is not None:  # the front's access line
                record.relayed(node.name, model, relayed.prompt_tokens, relayed.completion_tokens)
            if relayed.response_id and outcome == "ok":
                self._remember(relayed.response_id, node.name, principal.name)
            return None
        finally:
            self.metrics.proxied(node.name, model, outcome, time.monotonic() - started)

    async def _pass_back(self, path: str, send, node: PeerNode, upstream: httpx.Response,
                         relayed: Relayed) -> str:  # fmt: skip
        """Send the peer's answer to the client; the outcome for metrics."""
        status, ok = upstream.status_code, 200 <= upstream.status_code < 300
        sent = upstream.headers.raw
        content_type = next((v for k, v in sent if k.lower() == b"content-type"), b"")
        headers = [*_passed_on(sent), (NODE_HEADER, node.name.encode())]
        if ok and content_type.startswith(b"text/event-stream"):
            headers.append((b"content-type", b"text/event-stream; charset=utf-8"))
            return await self._pass_events(send, node, upstream, relayed, status, headers)
        try:
            raw = await read_capped(upstream, MAX_WHOLE_RESPONSE)
        except (TooLarge, httpx.HTTPError) as e:
            why = f"sent an answer {e}" if isinstance(e, TooLarge) else describe(e)
            node.mark_down(f"{node.config.base_url} failed mid-answer: {why}")
            response = error_response(path, 502, f"peer {node.name} failed mid-answer: {why}",
                                      code="peer_failed")  # fmt: skip
            await response({"type": "http"}, None, _tagged(send, node.name))
            return "failed"
        body, error = _json(raw), 400 <= status < 600
        if not (isinstance(body, dict) if ok else error and _api_error(api_of(path), body)):
            what = "not a JSON object" if ok else "not an error in the API's shape"
            kind, shown = excerpt(content_type, 60) or "no content type", excerpt(raw)
            response = error_response(
                path, status if error else 502,
                f"peer {node.name} answered {status} with {kind}, {what}"
                + (f': "{shown}"' if shown else ""), code="peer_failed",
                headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers})  # fmt: skip
            await response({"type": "http"}, None, send)
            return "error" if error else "failed"
        relayed.whole(body)
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": raw, "more_body": False})
        return "ok" if ok else "error"

    async def _pass_events(self, send, node: PeerNode, upstream: httpx.Response, relayed: Relayed,
                           status: int, headers: list) -> str:  # fmt: skip
        """Relay an SSE stream whole events at a time; the outcome for metrics."""
        await send({"type": "http.response.start", "status": status, "headers": headers})
        events, outcome = EventSplitter(MAX_EVENT), "ok"
        try:
            async for chunk in upstream.aiter_raw():
                out = [event for event in events.feed(chunk) if relayed.keep(event)]
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": True})  # fmt: skip
            if not relayed.ended:
                raise httpx.RemoteProtocolError("the stream ended before its last event")
        except (TooLarge, httpx.HTTPError) as e:
            if isinstance(e, TooLarge):
                why = f"sent an event {e}"
            elif isinstance(e, httpx.ReadTimeout):
                why = f"sent nothing for {node.config.read_timeout_s:g} s"
            else:
                why = describe(e)
            node.mark_down(f"{node.config.base_url} failed mid-stream: {why}")
            message = f"peer {node.name} failed mid-stream ({why}); the next request goes elsewhere"
            await send({"type": "http.response.body", "body": relayed.error_event(message),
                        "more_body": True})  # fmt: skip
            outcome = "failed"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return outcome

    def _account(self, principal: Principal, relayed: Relayed, outcome: str) -> None:
        """The key's tokens and request, as for a request served here."""
        key, tokens = principal.name, relayed.prompt_tokens + relayed.completion_tokens
        if tokens:
            principal.usage.count_tokens(time.monotonic(), tokens)
        self.metrics.key_prompt_tokens(key, relayed.prompt_tokens)
        self.metrics.key_generation.labels(key).inc(relayed.completion_tokens)
        self.metrics.key_requests.labels(key, "ok" if outcome == "ok" else "error").inc()

    def _remember(self, response_id: str, node: str, key: str) -> None:
        self._affinity[response_id] = (node, key)
        self._affinity.move_to_end(response_id)
        while len(self._affinity) > AFFINITY_SIZE:
            self._affinity.popitem(last=False)


class _Unavailable(Exception):
    pass


class EventSplitter:
    """A byte stream cut into whole SSE events (each with its blank line),
    none held past `limit` bytes: TooLarge then. Each byte is scanned once,
    however small the pieces it comes in."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pending = bytearray()
        self._scanned = 0  # of _pending, where the search for a blank line goes on

    def feed(self, chunk: bytes) -> list[bytes]:
        pending = self._pending
        pending += chunk
        events, start = [], 0
        while (end := pending.find(b"\n\n", max(start, self._scanned))) >= 0:
            if end + 2 - start > self.limit:
                raise TooLarge(self.limit)
            events.append(bytes(pending[start : end + 2]))
            start = end + 2
        del pending[:start]
        if len(pending) > self.limit:
            raise TooLarge(self.limit)
        self._scanned = max(0, len(pending) - 1)  # a last "\n" may begin the blank line
        return events


def _passed_on(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The peer's headers its client gets (`_PASSED_ON`'s comment says why so few)."""
    out = []
    for name, value in headers:
        name = name.lower()
        if name in _PASSED_ON or (name.startswith(_SPECGATE_PREFIX) and name != NODE_HEADER):
            out.append((name, value))
    return out


def _json(raw: bytes) -> object:
    """`raw` parsed, or None when it is not JSON (or nests past Python's limit)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _api_error(api: str, body: object) -> bool:
    """Whether `body` is an error in the API's own shape (gateway/errors.py)."""
    if not isinstance(body, dict) or (api == "anthropic" and body.get("type") != "error"):
        return False
    error = body.get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str)


_MARKUP = re.compile(r"<[^>]*>?")


def excerpt(raw: bytes, limit: int = 120) -> str:
    """A few words of what a peer sent, fit for an error message: its first
    bytes only, decoded leniently, markup and control characters out."""
    text = _MARKUP.sub(" ", raw[: limit * 8].decode("utf-8", "replace"))
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[:limit] + "..."


async def _whole_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _tagged(send, node: str):
    async def tagged(message):
        if message["type"] == "http.response.start":
            message = message | {"headers": [*message.get("headers", []), (NODE_HEADER, node.encode())]}
        await send(message)

    return tagged
