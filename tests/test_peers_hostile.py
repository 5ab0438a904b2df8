"""Peers are clients too: a front `specgate serve` routing to a peer that
misbehaves on purpose, and what the front's clients see of it.

The peer is FAILURE INJECTION: a small Starlette app served by a real
uvicorn in this process (conftest.serve_in_process) that answers as a broken
or hostile node (or whatever answers at a peer's address) would: a
/v1/models body with no end or one that trickles, an SSE event with no end,
an HTML error page with cookies, JSON that is not an API error. The front
must cap what it reads, keep the peer's cookies and hop headers from its
clients, and answer in the API's own error shape."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import serve_in_process, start_gateway, stop_gateway

from specgate.gateway.cluster.peers import TooLarge
from specgate.gateway.cluster.proxy import EventSplitter, excerpt

FLOOD = 128 << 20  # what the peer sends of an endless body at most (main read all of it)
SSE_FLOOD = 16 << 20  # of an endless SSE event (main buffered it all)
PEER_MODELS = ("sse-flood", "html-502", "not-an-error", "api-429", "captive-portal")
HTML_502 = ("<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1>"
            "<script>alert('x')</script>" + "<p>padding</p>" * 20000 + "<hr>nginx</body></html>")  # fmt: skip


# -- the pieces, as plain functions -----------------------------------------------------------


def test_events_are_cut_whole_whatever_pieces_they_come_in_and_capped():
    stream = b'data: {"a": 1}\n\nevent: x\ndata: 2\n\ndata: [DONE]\n\n'
    for size in (1, 2, 7, len(stream)):
        splitter = EventSplitter(64)
        got = [e for i in range(0, len(stream), size) for e in splitter.feed(stream[i : i + size])]
        assert got == [b'data: {"a": 1}\n\n', b"event: x\ndata: 2\n\n", b"data: [DONE]\n\n"]
    splitter = EventSplitter(64)
    assert splitter.feed(b"data: " + b"x" * 50) == []
    with pytest.raises(TooLarge, match="over 64 bytes"):  # an event with no end
        splitter.feed(b"x" * 20)
    with pytest.raises(TooLarge):  # a whole one, past the cap in one piece
        EventSplitter(64).feed(b"data: " + b"x" * 80 + b"\n\n")


def test_excerpt_is_short_and_has_no_markup():
    page = b"<html><h1>502 Bad Gateway</h1>\r\n<hr>nginx\x00</html>"
    assert excerpt(page) == "502 Bad Gateway nginx"
    assert excerpt(b"<scr<script>ipt>alert(1)</script>") == "ipt>alert(1)"  # no "<" survives
    assert len(excerpt(b"word " * 10000)) <= 123 and excerpt(b"\xff\xfe") == "\ufffd\ufffd"


# -- a front and a hostile peer on loopback ---------------------------------------------------


def hostile_app(state):
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def flood(head: bytes, size: int, tail: bytes):
        """`head`, then `size` bytes of padding, then `tail` (the end main's
        code waited for); until the module's peer stops."""
        yield head
        chunk, sent = b"x" * (1 << 20), 0
        while sent < size and not state.stopping:
            yield chunk
            sent += len(chunk)
        yield tail

    async def trickle():
        yield b'{"object": "list", "data": ['
        while not state.stopping:  # a byte well within any read timeout, forever
            await asyncio.sleep(0.2)
            yield b" "

    async def models(request):
        if state.models == "flood":  # valid JSON, were it ever read to its end
            return StreamingResponse(flood(b'{"object": "list", "data": [], "pad": "', FLOOD, b'"}'),
                                     media_type="application/json")  # fmt: skip
        if state.models == "trickle":
            return StreamingResponse(trickle(), media_type="application/json")
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "specgate": {"running": 0, "waiting": 0,
                                                      "max_concurrent": 8, "state": "ready"}}
            for m in PEER_MODELS]})  # fmt: skip

    async def generate(request):
        model = (await request.json())["model"]
        if model == "sse-flood":  # one good event, then one that never ends
            first = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
            return StreamingResponse(flood(first + b'data: {"pad": "', SSE_FLOOD, b'"}\n\n'),
                                     media_type="text/event-stream")  # fmt: skip
        if model == "html-502":  # a reverse proxy's page, with what a client must not get
            return HTMLResponse(HTML_502, status_code=502, headers={
                "Set-Cookie": "session=peer-secret; Path=/", "X-Evil": "1", "Server": "nginx",
                "Keep-Alive": "timeout=5", "Alt-Svc": 'h3=":443"', "Retry-After": "7",
                "X-Specgate-Plan": "method=plain", "X-Specgate-Node": "spoofed"})  # fmt: skip
        if model == "not-an-error":  # JSON, but not the API's error shape
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if model == "api-429":  # a real API error: passed on as it is
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error",
                                           "param": None, "code": "rate_limit_exceeded"}},
                                status_code=429, headers={"Retry-After": "3"})  # fmt: skip
        return Response("<p>captive portal</p>", media_type="text/html")  # a 200 that is no answer

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/messages", generate, methods=["POST"])])  # fmt: skip


@pytest.fixture(scope="module")
def peer():
    state = SimpleNamespace(models="good", stopping=False)
    with serve_in_process(hostile_app(state)) as url:
        state.url = url
        try:
            yield state
        finally:
            state.stopping = True  # its endless bodies end: uvicorn can stop


@pytest.fixture(scope="module")
def front(peer, tmp_path_factory):
    """A front with no model of its own, routing to the hostile peer (no
    keys: an open loopback server, so /admin/status shows the peer)."""
    gw = start_gateway({"models": [], "peers": [
        {"name": "hostile", "url": peer.url, "health_interval_s": 0.3, "max_backoff_s": 0.6,
         "check_timeout_s": 1.5}]}, tmp_path_factory.mktemp("hostile"))  # fmt: skip
    try:
        yield gw
    finally:
        stop_gateway(gw)


def peer_state(front) -> dict:
    return httpx.get(front.base_url + "/admin/status", timeout=10).json()["peers"][0]


def wait_for(front, test, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while not test(state := peer_state(front)):
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    return state


def peak_rss(gw) -> int:
    """The front process's peak resident memory so far (Linux /proc), bytes."""
    for line in Path(f"/proc/{gw.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def chat(front, model: str, path: str = "/chat/completions") -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(front.api + path, json=body, timeout=60)


def test_a_models_body_with_no_end_is_cut_at_the_cap(front, peer):
    wait_for(front, lambda s: s["up"])
    before = peak_rss(front)
    peer.models = "flood"
    try:
        state = wait_for(front, lambda s: not s["up"])
        assert "answered a /v1/models body over 1 MiB" in state["problem"]
        assert peak_rss(front) - before < 64 << 20  # main's grew by the whole body (and more)
        # The front still answers, and says why the peer's models cannot be served.
        assert httpx.get(front.api + "/models").status_code == 200
        r = chat(front, "html-502")
        assert r.status_code == 503 and "over 1 MiB" in r.json()["error"]["message"]
    finally:
        peer.models = "good"
    wait_for(front, lambda s: s["up"])


def test_a_models_body_that_trickles_is_cut_at_the_checks_time_cap(front, peer):
    wait_for(front, lambda s: s["up"])
    # Each byte comes in time for a read's timeout: only the whole check's deadline ends it.
    peer.models = "trickle"
    try:
        state = wait_for(front, lambda s: not s["up"])
        assert "did not answer /v1/models within 1.5 s" in state["problem"]
    finally:
        peer.models = "good"
    wait_for(front, lambda s: s["up"])


def test_an_sse_event_with_no_end_ends_the_stream_with_one_error_event(front):
    wait_for(front, lambda s: s["up"])
    body = {"model": "sse-flood", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", front.api + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "hi"  # the event before
    error = json.loads(events[1][6:])["error"]
    assert "peer hostile failed mid-stream" in error["message"] and "over 1 MiB" in error["message"]
    assert events[2:] == ["data: [DONE]"]
    wait_for(front, lambda s: s["up"])  # the front goes on: the peer is back at its next check


def test_a_peers_html_page_and_cookies_never_reach_the_client(front):
    wait_for(front, lambda s: s["up"])
    r = chat(front, "html-502")
    assert r.status_code == 502 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "peer_failed"
    message = error["message"]
    assert message.startswith("peer hostile answered 502") and "502 Bad Gateway" in message
    assert "<" not in message and len(message) < 400  # a short excerpt, tags out
    for header in ("set-cookie", "x-evil", "keep-alive", "alt-svc"):
        assert header not in r.headers, header
    assert "nginx" not in r.headers.get_list("server")
    assert r.headers.get_list("x-specgate-node") == ["hostile"]  # this node's tag, not the peer's
    assert r.headers["retry-after"] == "7" and r.headers["x-specgate-plan"] == "method=plain"

    # Anthropic's route: Anthropic's shape.
    r = chat(front, "html-502", "/messages")
    assert r.status_code == 502 and "set-cookie" not in r.headers
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("peer hostile answered 502")

    # JSON that is not an API error keeps its 4xx; a 200 that is no JSON is a 502.
    r = chat(front, "not-an-error")
    assert r.status_code == 404 and "peer hostile answered 404" in r.json()["error"]["message"]
    r = chat(front, "captive-portal")
    assert r.status_code == 502
    assert "peer hostile answered 200 with text/html" in r.json()["error"]["message"]

    # A peer's error in the API's shape is passed on as it is.
    r = chat(front, "api-429")
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"] == {"message": "slow down", "type": "rate_limit_error", "param": None,
                                 "code": "rate_limit_exceeded"}  # fmt: skip
