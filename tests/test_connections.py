"""Idle and slow sockets do not starve the server (gateway/server.py,
gateway/access/connections.py, the body deadline in gateway/access/limits.py).

One real `specgate serve` with short deadlines. It starts with a soft limit
of 1024 open files, as many systems give a process (macOS: 256; importing
mlx_lm then makes it 2048), and raises it; the test process raises its own
to open thousands of sockets. Many clients on one host: source addresses
127.0.0.2 and up (all of 127/8 is loopback on Linux; elsewhere those tests
skip).
"""

from __future__ import annotations

import http.client
import json
import re
import resource
import select
import socket
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from conftest import serve_in_process, start_gateway, stop_gateway
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from specgate.gateway.access.connections import ConnectionLimits
from specgate.gateway.config import ServerConfig
from specgate.gateway.server import guarded_protocol

SPAWN_SOFT_LIMIT = 1024  # the gateway's soft limit of open files when it starts
HEADER_TIMEOUT_S, BODY_DEADLINE_S, PER_CLIENT = 1, 3, 20
MARGIN_S = 8  # on top of a deadline: the machine is shared and noisy
# Idle sockets, PER_CLIENT from each of FLOOD / PER_CLIENT addresses: more
# than the 2048 open files mlx_lm's import leaves a process.
FLOOD = 2200


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, SPAWN_SOFT_LIMIT), hard))
    try:  # (the gateway inherits the limit; the test process gets its own back at once)
        gw = start_gateway({
            "server": {"header_timeout_s": HEADER_TIMEOUT_S, "body_deadline_s": BODY_DEADLINE_S,
                       "max_connections_per_client": PER_CLIENT},
            "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048}],
        }, tmp_path_factory.mktemp("connections"))  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    yield gw
    stop_gateway(gw)


def address(gw) -> tuple[str, int]:
    host, port = gw.base_url.removeprefix("http://").split(":")
    return host, int(port)


def connect(gw, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(address(gw), timeout=HEADER_TIMEOUT_S + MARGIN_S,
                                    source_address=(source, 0))  # fmt: skip


def loopback_source(source: str) -> str:
    """`source` if this host can send from it, else skip."""
    with socket.socket() as s:
        try:
            s.bind((source, 0))
        except OSError:
            pytest.skip(f"{source} is not a loopback address here (Linux has all of 127/8)")
    return source


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset ends it too)."""
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply


def error_of(reply: bytes) -> tuple[int, str]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]["code"]


def metric(gw, name: str) -> float:
    text = httpx.get(gw.base_url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def refused(gw, reason: str) -> float:
    return metric(gw, f'specgate_connections_refused_total{{reason="{reason}"}}')


def test_the_open_files_limit_is_raised_and_reported(gw):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= SPAWN_SOFT_LIMIT:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    limit = metric(gw, "specgate_fd_limit")
    assert limit > SPAWN_SOFT_LIMIT
    if (
        sys.platform == "linux"
    ):  # the soft limit is the gateway's hard one (mlx_lm lowers that to 4096)
        limits = Path(f"/proc/{gw.process.pid}/limits").read_text()
        assert re.search(rf"^Max open files +{int(limit)} +{int(limit)} ", limits, re.M), limits
    assert f"open files: at most {int(limit)} (raised from " in gw.log()
    assert 0 < metric(gw, "specgate_open_fds") < limit


def test_an_idle_connection_is_closed_at_the_header_deadline(gw):
    with connect(gw) as sock:
        t0 = time.monotonic()
        reply = read_all(sock)
        waited = time.monotonic() - t0
    assert reply == b""  # nothing came, so nothing is answered
    assert HEADER_TIMEOUT_S / 2 < waited < HEADER_TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("after_a_response", [False, True], ids=["fresh", "keep-alive"])
def test_headers_sent_a_byte_at_a_time_get_408(gw, after_a_response):
    """The deadline runs from the connection's opening, and on keep-alive
    from the previous response's end (uvicorn's keep-alive timer stops at
    the first byte after it)."""
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 60 + b"\r\n\r\n"
    with connect(gw) as sock:
        if after_a_response:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            first = http.client.HTTPResponse(sock)
            first.begin()
            assert first.status == 200 and first.read() == b'{"status":"ok"}'
        t0, sent = time.monotonic(), 0
        # A byte every 0.1 s (all of it would take 8 s), until the server answers.
        while sent < len(request) and not select.select([sock], [], [], 0.1)[0]:
            try:
                sent += sock.send(request[sent : sent + 1])
            except OSError:
                break  # closed on us
        reply = read_all(sock)
        waited = time.monotonic() - t0
    assert sent < len(request), reply
    assert waited < HEADER_TIMEOUT_S + MARGIN_S
    if reply:  # (a byte that crossed the close may have reset the connection first)
        assert error_of(reply) == (408, "headers_timeout")


def test_a_trickled_body_gets_408_at_the_body_deadline(gw):
    """A byte every 0.25 s never trips body_timeout_s (30 s between pieces);
    the whole body is due BODY_DEADLINE_S after its headers."""
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n")  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < BODY_DEADLINE_S + MARGIN_S:
            if select.select([sock], [], [], 0.25)[0]:
                break
            sock.sendall(b" ")
        reply = read_all(sock)
        waited = time.monotonic() - t0
    assert reply, "no answer while the body trickled"
    assert error_of(reply) == (408, "body_timeout")
    assert (
        f"within {BODY_DEADLINE_S} s"
        in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]
    )
    assert BODY_DEADLINE_S / 2 < waited < BODY_DEADLINE_S + MARGIN_S


def held_open(sock: socket.socket) -> socket.socket:
    """A connection the server keeps for BODY_DEADLINE_S: its headers came,
    its body never does (a socket that sent nothing would be closed at the
    much shorter header deadline)."""
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                 b"content-type: application/json\r\ncontent-length: 100\r\n\r\n")  # fmt: skip
    return sock


def test_connections_past_the_per_client_cap_are_closed_at_once(gw):
    crowded, other = loopback_source("127.0.0.3"), loopback_source("127.0.0.2")
    before = refused(gw, "per_client")
    with ExitStack() as stack:
        for _ in range(PER_CLIENT):
            stack.enter_context(held_open(connect(gw, crowded)))
        with connect(gw, crowded) as extra:  # closed unanswered (by the cap: the count below)
            assert read_all(extra) == b""
        # Another address is served meanwhile.
        with httpx.Client(transport=httpx.HTTPTransport(local_address=other)) as client:
            assert client.get(gw.api + "/models", timeout=30).status_code == 200
        assert refused(gw, "per_client") == before + 1


def test_thousands_of_idle_sockets_do_not_starve_the_server(gw):
    """FLOOD idle sockets (past the open files the gateway started with),
    PER_CLIENT from each address: a model listing and a chat
    completion are answered meanwhile, and the header deadline closes every
    idle one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FLOOD + 1000  # this process holds the sockets
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"this process may open {hard} files, and needs {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    sources = [loopback_source(f"127.0.1.{i}") for i in range(1, FLOOD // PER_CLIENT + 1)]
    timeouts_before = metric(gw, "specgate_connections_header_timeouts_total")
    with ExitStack() as stack:
        stack.callback(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))  # (last out)
        idle = [stack.enter_context(connect(gw, source))
                for source in sources for _ in range(PER_CLIENT)]  # fmt: skip
        models = httpx.get(gw.api + "/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        chat = httpx.post(gw.api + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
        t0 = time.monotonic()
        for sock in idle:  # each closed by the server, none answered
            assert read_all(sock) == b""
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + MARGIN_S
    assert refused(gw, "fd_reserve") == 0
    assert metric(gw, "specgate_connections_header_timeouts_total") >= timeouts_before + FLOOD
    assert gw.alive() and "Too many open files" not in gw.log()


def test_connections_near_the_open_files_limit_are_closed_at_once():
    """The descriptor reserve, with the limit it is computed from set small
    (40: room for 30 connections): the process's real limit is far too high
    to reach here. A real uvicorn in this process, with specgate's protocol."""
    limits = ConnectionLimits(per_client=0, fd_limit=40)
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    with serve_in_process(app, http=guarded_protocol(ServerConfig(), limits)) as base:
        host, port = base.removeprefix("http://").split(":")
        with ExitStack() as stack:
            for _ in range(limits.max_open):
                stack.enter_context(socket.create_connection((host, int(port)), timeout=30))
            with socket.create_connection((host, int(port)), timeout=30) as extra:
                assert read_all(extra) == b""
            assert limits.refused == {"per_client": 0, "fd_reserve": 1}
        deadline = time.monotonic() + 30  # the held ones close, and room comes back
        while limits.open and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(base, timeout=30).text == "ok"
