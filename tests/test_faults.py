"""Clients that give up, long prompts, and SIGTERM, against a real gateway.

The demo model's MTP engine (speculation, one sequence at a time) makes long
prefills easy to start: a prompt of a few thousand token ids takes many
seconds on this CPU, in chunks of 512. Waits here are hang guards, never
speed checks: what is asserted is an order of events or a log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.conftest import start_gateway, stop_gateway

MTP = {"X-Specgate-Method": "mtp"}


def long_prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def config(tiny_model, **server) -> dict:
    return {
        "server": {"shutdown_grace_s": 2, **server},
        "models": [
            {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"],
             "mtp_depth": 2},
            # Same weights twice: five at once, and one at a time with a queue.
            {"id": "tiny", "path": str(tiny_model), "max_concurrent": 5, "max_queue": 4,
             "max_context": 8192},
            {"id": "tiny-one", "path": str(tiny_model), "max_concurrent": 1, "max_queue": 4,
             "max_context": 8192},
        ],
    }


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    g = start_gateway(config(tiny_model), tmp_path_factory.mktemp("faults"))
    yield g
    stop_gateway(g)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def open_stream(gw, body: dict, headers: dict | None = None) -> socket.socket:
    """Send a streaming completion on a raw socket, so the test decides when
    the client goes away (close) without reading a byte."""
    host, port = gw.base_url.removeprefix("http://").split(":")
    payload = json.dumps(body | {"stream": True}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(payload)}\r\n{head}\r\n".encode() + payload)
    return sock


def gauge(gw, name: str, model: str) -> float:
    text = httpx.get(gw.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"specgate_{name}{{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def running(gw, model: str) -> float:
    return gauge(gw, "num_requests_running", model)


def test_abandoned_prefill_stops_within_a_chunk(gw):
    """A client that leaves during a long prefill: the engine stops at the
    next chunk (the log says how far it got) and the model serves again."""
    n = 8192
    sock = open_stream(gw, {"model": "demo", "prompt": long_prompt(n), "max_tokens": 4}, MTP)
    wait_for(lambda: running(gw, "demo") >= 1, 60, "the long request to start")
    time.sleep(1.0)
    sock.close()
    line = wait_for(lambda: next((ln for ln in gw.log().splitlines()
                                  if "stopped after prefilling" in ln), None), 120,
                    "the engine to stop the abandoned prefill")  # fmt: skip
    fed = int(line.split("stopped after prefilling ")[1].split(" of ")[0])
    assert fed < n, line
    wait_for(lambda: running(gw, "demo") == 0, 60, "num_requests_running to drop to 0")
    r = httpx.post(gw.api + "/completions", headers=MTP, timeout=120,
                   json={"model": "demo", "prompt": "def f():", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_long_prefill_of_one_model_does_not_hold_up_another(gw):
    """While one model prefills a long prompt, a short request to another
    model finishes first (before: one lock for all models made it wait for
    the whole prefill): when its answer is in, the long stream has not sent
    a byte of its body. Then the long one's client leaves (waiting out the
    prefill proved nothing more) and the model is seen idle again."""
    sock = open_stream(gw, {"model": "demo", "prompt": long_prompt(4096, seed=1),
                            "max_tokens": 2}, MTP)  # fmt: skip
    try:
        wait_for(lambda: running(gw, "demo") >= 1, 60, "the long prefill to start")
        r = httpx.post(gw.api + "/completions", timeout=300,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
        sock.setblocking(False)
        sent = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := sock.recv(65536):
                sent += chunk
        # (The status line and headers may be out; no body byte is.)
        head, _, body = sent.partition(b"\r\n\r\n")
        assert body == b"", f"the short request waited for the other model: {sent!r}"
    finally:
        sock.close()
    wait_for(lambda: running(gw, "demo") == 0, 120, "the abandoned prefill to stop")


def test_client_leaving_before_its_first_token_logs_no_traceback(gw):
    """A stream waiting in the model's queue whose client leaves: no
    traceback (it was 'aclose(): asynchronous generator is already running')."""
    holder = open_stream(gw, {"model": "tiny-one", "prompt": "a", "max_tokens": 3000,
                              "ignore_eos": True})
    wait_for(lambda: running(gw, "tiny-one") >= 1, 60, "the slot to be taken")
    before = gw.log()
    for _ in range(3):
        waiter = open_stream(gw, {"model": "tiny-one", "prompt": "b", "max_tokens": 4})
        time.sleep(0.6)  # queued behind the holder, then gone
        waiter.close()
    holder.close()
    wait_for(lambda: running(gw, "tiny-one") == 0, 60, "the holder to be cancelled")
    time.sleep(0.5)
    new = gw.log()[len(before):]
    assert "Traceback" not in new and "already running" not in new, new


# -- SIGTERM ------------------------------------------------------------------------------


def read_stream(gw, body: dict, headers: dict, out: list, started: threading.Event) -> None:
    """The raw SSE text of one stream, or the status and body of a refusal."""
    try:
        with httpx.stream("POST", gw.api + "/completions", headers=headers, timeout=120,
                          json=body | {"stream": True}) as r:
            if r.status_code != 200:
                out.append((r.status_code, r.read().decode()))
                return
            started.set()
            out.append((200, "".join(r.iter_text())))
    except httpx.HTTPError as e:
        out.append((0, repr(e)))


def sse_events(text: str) -> list[str]:
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block.strip()]


def sigterm_and_wait(g, bound: float) -> float:
    t0 = time.monotonic()
    os.killpg(g.process.pid, signal.SIGTERM)
    try:
        g.process.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(g.process.pid, signal.SIGKILL)
        g.process.wait()
        raise AssertionError(f"no exit within {bound} s of SIGTERM:\n{g.log()}") from None
    return time.monotonic() - t0


def test_sigterm_ends_streams_in_flight_with_an_error_event_and_done(tiny_model, tmp_path):
    g = start_gateway(config(tiny_model), tmp_path)
    try:
        results: list[list] = [[] for _ in range(6)]
        started = [threading.Event() for _ in range(6)]
        body = {"model": "tiny", "prompt": "x", "max_tokens": 6000, "ignore_eos": True}
        threads = [threading.Thread(target=read_stream, args=(g, body, {}, results[i], started[i]))
                   for i in range(5)]
        for t in threads:
            t.start()
        for e in started[:5]:
            assert e.wait(60), "a stream did not start"
        # A sixth waits in the queue (five decode at once).
        queued = threading.Thread(target=read_stream, args=(g, body, {}, results[5], started[5]))
        queued.start()
        wait_for(lambda: gauge(g, "num_requests_waiting", "tiny") >= 1, 60, "the sixth to queue")
        took = sigterm_and_wait(g, 2 + 20)  # grace 2 s: exit soon after
        for t in [*threads, queued]:
            t.join(timeout=30)
    finally:
        stop_gateway(g)
    for (status, text), in results[:5]:
        assert status == 200, text
        events = sse_events(text)
        assert events[-1] == "[DONE]", text[-300:]
        last = json.loads(events[-2])
        assert "error" in last and last["error"]["code"] == "shutting_down", last
    status, text = results[5][0]
    assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", results[5]
    assert "Traceback" not in g.log()
    assert took < 22


def test_sigterm_during_a_long_prefill_exits_within_the_grace(tiny_model, tmp_path):
    g = start_gateway(config(tiny_model), tmp_path)
    out: list = []
    try:
        t = threading.Thread(target=read_stream, args=(
            g, {"model": "demo", "prompt": long_prompt(20000), "max_tokens": 4}, MTP, out,
            threading.Event()))
        t.start()
        wait_for(lambda: running(g, "demo") >= 1, 60, "the prefill to start")
        time.sleep(1.0)
        took = sigterm_and_wait(g, 2 + 20)
        t.join(timeout=30)
    finally:
        stop_gateway(g)
    # Still in prefill when the grace ran out. Past server.stream_keepalive_s
    # the stream had started (keep-alives while the prompt prefilled, none
    # yet if the shutdown came within the first period), so the shutdown is
    # its error event, then [DONE]; before that, the 503 itself.
    status, text = out[0]
    if status == 200:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert len(events) == 2 and events[-1] == "[DONE]", out  # no token came
        assert json.loads(events[0])["error"]["code"] == "shutting_down", out
    else:
        assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", out
    assert "stopped after prefilling" in g.log()
    assert took < 22
