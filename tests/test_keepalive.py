"""Long prompts don't look dead: a stream whose first token is slow sends
keep-alives while the prompt is prefilled (an SSE comment on the OpenAI
routes, Anthropic's `ping` event), and a client that leaves then still
stops the work. Through a real server, with `server.stream_keepalive_s`
small and a prompt long enough that its prefill takes several periods.

Before, nothing at all was sent until the first token: a 100k-token agent
turn looked like a dead server."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import start_gateway, stop_gateway

PERIOD_S = 0.2
PROMPT_TOKENS = 3_000


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    gw = start_gateway(
        {
            "server": {"stream_keepalive_s": PERIOD_S, "max_body_bytes": 8 << 20},
            "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 8192}],
        },  # fmt: skip
        tmp_path_factory.mktemp("keepalive"),
    )
    yield gw
    stop_gateway(gw)


def long_text(word: str) -> str:
    """About PROMPT_TOKENS tokens, a different text per request (a prefix
    cache hit would skip the prefill)."""
    return f"{word} beta gamma delta " * (PROMPT_TOKENS // 10)


REQUESTS = {
    "completions": ("/v1/completions", {"prompt": [10 + i % 2000 for i in range(PROMPT_TOKENS)]}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text("one")}]}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": long_text("two")}]}),
    "responses": ("/v1/responses", {"input": long_text("three")}),
    "leaving": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": long_text("four")}]},
    ),
}


def keepalive(line: bytes) -> bool:
    return line.startswith(b": keepalive") or line == b"event: ping"


def first_token(line: bytes) -> bool:
    """The line carrying the first generated text, in each API's events."""
    return line.startswith(b"data: ") and any(k in line for k in (
        b'"delta":{"content"', b'"delta": {"content"', b'"text":"', b'"text": "',
        b'"type":"content_block_delta"', b'"type": "content_block_delta"',
        b'"type": "response.output_text.delta"', b'"type":"response.output_text.delta"'))  # fmt: skip


@pytest.mark.parametrize("api", ["completions", "chat", "messages", "responses"])
def test_a_slow_first_token_is_preceded_by_keepalives(server, api):
    path, body = REQUESTS[api]
    body = body | {"model": "tiny", "stream": True, "temperature": 0,
                   ("max_output_tokens" if api == "responses" else "max_tokens"): 4}  # fmt: skip
    arrivals: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", server.base_url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            arrivals.append((time.monotonic() - t0, line.encode()))
    alive = [t for t, line in arrivals if keepalive(line)]
    first = next(t for t, line in arrivals if first_token(line) and not keepalive(line))
    assert [t for t in alive if t < first], (first, alive)
    # Every wait before the first token is bounded by the period (the issue
    # asks for one at least every 5 s; the period here is 0.2 s).
    gaps = [b - a for a, b in zip([0.0, *alive], [*alive, first], strict=True) if a < first]
    assert max(gaps) < 5.0, gaps


def test_a_client_leaving_during_the_keepalives_stops_the_prefill(server):
    path, body = REQUESTS["leaving"]
    body = body | {"model": "tiny", "stream": True, "max_tokens": 4}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=300) as r:
        for line in r.iter_lines():
            if keepalive(line.encode()):
                break  # leave after the first keep-alive, mid-prefill
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for _ in range(100):
            load = client.get("/v1/models").json()["data"][0]["specgate"]
            if load["running"] == 0 and load["waiting"] == 0:
                break
            time.sleep(0.1)
        assert load["running"] == 0, load
