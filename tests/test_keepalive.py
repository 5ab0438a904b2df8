"""Long prompts don't look dead: a stream whose first token is slow sends
keep-alives while the prompt is prefilled (an SSE comment on the OpenAI
routes, Anthropic's `ping` event), and a client that leaves then still
stops the work. Through a real server, with `server.stream_keepalive_s`
small and a prompt long enough that its prefill takes several periods.

Before, nothing at all was sent until the first token: a 100k-token agent
turn looked like a dead server."""

from __future__ import annotations

import re
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
            "server": {"stream_keepalive_s": PERIOD_S, "max_body_bytes": "8MiB"},
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


def stalls(gw) -> str:
    """What the gateway's loop watch (gateway/serving/loop_watch.py) logged:
    where its event loop was stuck, and when the whole process was held up
    (by a thread holding the GIL, or a machine too busy to run it)."""
    log = gw.log()
    held = [line for line in log.splitlines() if "the whole process was held up" in line]
    at = log.find("the event loop has not answered")
    stuck = log[at : at + 6000] if at >= 0 else "(the loop watch saw no stall)"
    return "\n".join([*held, stuck])


def starved(gw) -> list[tuple[float, float]]:
    """(start, end), on this machine's monotonic clock, of each time the
    gateway's loop watch saw its whole process wait for a CPU most of the
    time (gateway/serving/loop_watch.py): the OS ran none of it then, so no
    server could have sent a byte. A CI machine running agents, builds and
    proofs beside this test had load 15 on 2 cores and left the gateway
    runnable but unrun for 22 s at a stretch."""
    found = re.finditer(r"held up for ([\d.]+) s \(from monotonic ([\d.]+)\), ([\d.]+) s of it "
                        r"waiting for a CPU", gw.log())  # fmt: skip
    return [(float(m[2]), float(m[2]) + float(m[1])) for m in found if float(m[3]) > float(m[1]) / 2]


def cpu_wait(pid: int | None = None) -> float:
    """Seconds a thread has been runnable without a CPU (Linux's schedstat;
    0 where the kernel does not say, as on macOS): this one, or process
    `pid`'s main thread (the gateway's event loop, which sends the
    keep-alives)."""
    import threading

    task = f"/proc/self/task/{threading.get_native_id()}" if pid is None else f"/proc/{pid}/task/{pid}"
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Arrivals:
    """Each line of a stream as it came: (monotonic time, this client's CPU
    wait so far, the gateway's event loop's CPU wait so far, the line)."""

    def __init__(self, gw):
        self.gw, self.pid = gw, gw.process.pid
        self.t0, self.client0, self.server0 = time.monotonic(), cpu_wait(), cpu_wait(self.pid)
        self.lines: list[tuple[float, float, float, bytes]] = []

    def add(self, line: bytes) -> None:
        self.lines.append((time.monotonic(), cpu_wait() - self.client0, cpu_wait(self.pid) - self.server0,
                           line))  # fmt: skip

    def silences(self, until: float) -> list[tuple[float, float, float]]:
        """Each wait between keep-alives, from the request's start until the
        first token at `until`: (its start, its length, its length less the
        time the OS ran neither side: the gateway's event loop runnable
        without a CPU (its schedstat, or the loop watch's report of its
        whole process held up, `starved`), or this client likewise)."""
        away = starved(self.gw)
        marks = [(self.t0, 0.0, 0.0)] + [(t, c, w) for t, c, w, line in self.lines
                                          if keepalive(line) and t < until]  # fmt: skip
        end = next(((c, w) for t, c, w, _ in self.lines if t >= until), marks[-1][1:])
        out = []
        for (a, ca, wa), (b, cb, wb) in zip(marks, [*marks[1:], (until, *end)], strict=True):
            logged = sum(max(0.0, min(b, e) - max(a, s)) for s, e in away)
            out.append((a, b - a, b - a - max(logged, wb - wa, cb - ca)))
        return out

    def check(self, until: float, limit: float = 5.0) -> None:
        """No silence longer than `limit` but for the time the OS ran neither
        side; failing, says everything (pytest would cut an assert's message)."""
        gaps = self.silences(until)
        at, raw, worst = max(gaps, key=lambda g: g[2])
        if worst >= limit:
            pytest.fail(f"{worst:.1f} s unexcused without a keep-alive ({raw:.1f} s from monotonic "
                        f"{at:.3f}); every wait (start, length, unexcused): {gaps}\n"
                        f"lines: {[(round(t, 3), round(c, 2), round(w, 2), line[:60]) for t, c, w, line in self.lines]}"
                        f"\ngateway's loop watch:\n{stalls(self.gw)}", pytrace=False)  # fmt: skip


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
    arrivals = Arrivals(server)
    with httpx.stream("POST", server.base_url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            arrivals.add(line.encode())
    alive = [t for t, _, _, line in arrivals.lines if keepalive(line)]
    first = next(t for t, _, _, line in arrivals.lines if first_token(line) and not keepalive(line))
    assert [t for t in alive if t < first], (first, alive)
    # Every wait before the first token is bounded by the period (the issue
    # asks for one at least every 5 s; the period here is 0.2 s), but for
    # the time the OS ran neither the gateway nor this client.
    arrivals.check(first)


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


def test_prefill_progress_is_sent_where_asked(server):
    """`return_progress` (llama-server's): chunks with no choices and a
    `prompt_progress` whose count grows, then the tokens; they parse in the
    openai SDK's own chunk type, and a client reading only choices skips them."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", stream=True, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": long_text("five")}],
        extra_body={"return_progress": True},
    )  # fmt: skip
    progress, text = [], []
    for chunk in stream:
        if not chunk.choices:
            progress.append(chunk.model_extra["prompt_progress"])
        elif chunk.choices[0].delta.content:
            assert progress, "a token came before any progress"
            text.append(chunk.choices[0].delta.content)
    processed = [p["processed"] for p in progress]
    assert len(processed) > 1 and processed == sorted(processed), progress
    assert all(0 < p["processed"] < p["total"] for p in progress), progress
    assert text


# -- the issue's own measure: a 20k-token prompt, the default period ------------------
# In the agents tier (-m agents), beside the real agents: about a minute of
# prefill on this CPU, for what the 3,000-token tests above check in seconds
# through every API. One API at this size: the keep-alive is sent by the code
# all of them share (chat.keepalive_comment, FirstPiece.waiting), and the
# other two cost CI two more minutes of prefill for no other code path.

LONG_PROMPT_TOKENS = 20_000


@pytest.fixture(scope="module")
def default_server(tiny_model, tmp_path_factory):
    """The shipped keep-alive period (server.stream_keepalive_s left out), a
    context that takes a 20k-token prompt."""
    gw = start_gateway(
        {
            "server": {"max_body_bytes": "8MiB"},
            "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 32_768}],
        },  # fmt: skip
        tmp_path_factory.mktemp("keepalive-default"),
    )
    yield gw
    stop_gateway(gw)


@pytest.mark.agents
@pytest.mark.parametrize("api", ["chat"])
def test_a_20k_token_prompt_gets_a_keepalive_at_least_every_5_s(default_server, api):
    path = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
            "responses": "/v1/responses"}[api]  # fmt: skip
    text = f"{api} beta gamma delta " * (LONG_PROMPT_TOKENS // 9)  # 9-11 tokens each
    body = ({"input": text, "max_output_tokens": 2} if api == "responses" else
            {"messages": [{"role": "user", "content": text}], "max_tokens": 2})  # fmt: skip
    body |= {"model": "tiny", "stream": True, "temperature": 0}
    arrivals = Arrivals(default_server)
    with httpx.stream("POST", default_server.base_url + path, json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            arrivals.add(line.encode())
            if first_token(line.encode()):
                break
    first = arrivals.lines[-1][0]
    alive = [(t, line) for t, _, _, line in arrivals.lines if keepalive(line)]
    # The prefill must outlast a period, or this measures nothing.
    assert first - arrivals.t0 > 5.0 and alive, (first - arrivals.t0, alive)
    # At least every 5 s, but for the time the OS ran neither side.
    arrivals.check(first)
    if api != "messages":  # Anthropic's ping carries nothing; the comments say how far
        counts = [tuple(map(int, line.split()[-1].split(b"/"))) for _, line in alive
                  if re.fullmatch(rb": keepalive \d+/\d+", line)]  # fmt: skip
        assert counts, alive
        assert all(0 < done < total and total >= LONG_PROMPT_TOKENS for done, total in counts), counts
        assert [d for d, _ in counts] == sorted(d for d, _ in counts), counts


def test_the_wait_for_a_first_piece_counts_from_the_request_s_arrival():
    """`first_piece`'s patience (the keep-alive period) counts from the
    request's arrival, so time spent before it (rendering and tokenizing a
    long prompt) does not add to the client's silence; it still waits
    MIN_PATIENCE_S, so an error raised at once gets its status code."""
    import asyncio

    from starlette.requests import Request

    from specgate.gateway.access import access_log
    from specgate.gateway.api.chat import MIN_PATIENCE_S, first_piece

    async def waited(spent: float, patience: float) -> float:
        never = asyncio.Event()

        async def receive():  # a client that stays
            await never.wait()

        async def pieces():
            await never.wait()
            yield None

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        token = access_log._current.set(access_log.AccessRecord("req-test", time.perf_counter() - spent))
        try:
            t0 = time.monotonic()
            start = await first_piece(request, pieces(), patience)
            took = time.monotonic() - t0
            assert not start.done
            await start.close()
            return took
        finally:
            access_log._current.reset(token)

    assert 0.9 < asyncio.run(waited(0.0, 1.0)) < 1.5  # nothing spent before: the whole period
    assert asyncio.run(waited(0.8, 1.0)) < 0.7  # 0.8 s spent: what is left (0.25 s at least)
    assert asyncio.run(waited(5.0, 1.0)) >= MIN_PATIENCE_S - 0.05


def test_message_start_reports_the_cache_reads_of_a_slow_prompt(server):
    """message_start carries the prompt's usage, and its cache reads are
    known once the engine looked the prompt up, not once the first token
    came: a cached system prompt before a long new message (its prefill
    outlasts the patience before the response starts) still reads as
    cached there. Before, message_start went out at the patience's end
    with 0 cache reads (ci15's flake in test_prefix_cache_gateway, a loaded
    machine's slow first token), and message_delta had no input counts."""
    import anthropic

    c = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    system = long_text("six")
    c.messages.create(model="tiny", max_tokens=1, system=system,
                      messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    t0 = time.monotonic()
    with c.messages.stream(model="tiny", max_tokens=2, system=system,
                           messages=[{"role": "user", "content": long_text("seven")}]) as s:  # fmt: skip
        start = first = delta = None
        for event in s:
            if event.type == "message_start":
                start = event.message.usage
            elif event.type == "message_delta":
                delta = event.usage  # cumulative, as Anthropic's: the input counts too
            elif event.type == "content_block_delta" and first is None:
                first = time.monotonic() - t0
        final = s.get_final_message().usage
    # The new message's prefill outlasted the patience (or this shows nothing).
    assert first is not None and first > 2 * PERIOD_S, first
    assert start.cache_read_input_tokens > PROMPT_TOKENS // 2, start
    assert (start.input_tokens, start.cache_read_input_tokens) == \
        (delta.input_tokens, delta.cache_read_input_tokens) == \
        (final.input_tokens, final.cache_read_input_tokens)  # fmt: skip
    assert final.input_tokens > PROMPT_TOKENS // 2  # the new message's, prefilled


def test_waiting_for_a_first_piece_stops_once_its_condition_holds():
    """FirstPiece.waiting(until=...): Anthropic's stream waits so for the
    prompt's lookup before message_start, yielding a keep-alive at once and
    then each period, and stops when the condition holds though the piece
    has not come."""
    import asyncio

    from specgate.gateway.api.chat import FirstPiece

    async def body() -> int:
        never = asyncio.Event()

        async def pieces():
            await never.wait()
            yield None

        it = pieces()
        start = FirstPiece(asyncio.ensure_future(anext(it)), it)
        looked_up = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, looked_up.set)
        yields = 0
        async for _ in start.waiting(3600.0, until=looked_up.is_set):
            yields += 1
        assert not start.done
        await start.close()
        return yields

    assert asyncio.run(asyncio.wait_for(body(), 60)) == 1  # at once; the hour's next never came
