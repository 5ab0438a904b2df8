"""Several nodes behind one gateway: a front specgate (no model of its own,
its own keys) routing to two peer specgates on loopback, through the real
openai and anthropic SDKs. Routing and relaying as plain functions first."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest
from conftest import serve_in_process, start_gateway, stop_gateway
from test_access_log import line_of

from specgate.builders.embedding import build_qwen3_embedding
from specgate.gateway.access.keys import add_key
from specgate.gateway.cluster.peers import (
    Candidate,
    ModelLoad,
    PeerNode,
    Peers,
    choose,
    parse_models,
)
from specgate.gateway.cluster.proxy import Relayed, peek
from specgate.gateway.config import ConfigError, PeerConfig, parse_config

# -- routing and relaying, as plain functions ------------------------------------------------


def test_choose_least_loaded_then_this_node_then_by_name():
    order = choose([Candidate("b", 0.5), Candidate("a", 0.5), Candidate("local", 0.5),
                    Candidate("c", 0.0)])  # fmt: skip
    assert [c.node for c in order] == ["c", "local", "a", "b"]


def test_peer_load_counts_requests_sent_since_its_last_check():
    node = PeerNode(PeerConfig(name="a", url="http://127.0.0.1:1"))
    node.inflight["m"] += 1  # one of ours, already there when it was checked
    node.checked({"m": ModelLoad(running=3, waiting=1, capacity=4)})
    assert node.load("m") == 1.0  # 4 of 4, ours among them
    node.inflight["m"] += 1  # sent since: counted at once
    assert node.load("m") == 1.25
    node.inflight["m"] -= 2  # both ended
    assert node.load("m") == 0.75  # the 3 it had from others
    assert node.up and node.failures == 0
    node.failed_check("gone")
    node.failed_check("gone")
    assert not node.up and node.next_check_s() == 2 * node.config.health_interval_s


def test_parse_models_reads_load_and_tolerates_other_servers():
    got = parse_models({"data": [
        {"id": "x", "specgate": {"running": 2, "waiting": 1, "max_concurrent": 4, "state": "ready"}},
        {"id": "y"},  # not a specgate: load unknown
        {"id": "z", "specgate": {"running": -3, "waiting": "many", "max_concurrent": 0}},
        "junk", {"id": 5}]})  # fmt: skip
    assert got == {"x": ModelLoad(2, 1, 4, "ready"), "y": ModelLoad(), "z": ModelLoad(0, 0, 1, "ready")}
    with pytest.raises(ValueError):
        parse_models({"models": []})


def test_listing_sums_load_over_nodes_and_keeps_a_down_peers_models():
    peers = Peers([PeerConfig(name="a", url="http://h:1"), PeerConfig(name="b", url="http://h:2")])
    a, b = peers.nodes["a"], peers.nodes["b"]
    a.checked({"m": ModelLoad(1, 0, 2, "ready"), "only-a": ModelLoad(0, 0, 1, "loading")})
    b.checked({"m": ModelLoad(0, 2, 4, "unloaded")})
    local = [{"id": "m", "object": "model", "created": 1, "owned_by": "specgate",
              "specgate": {"running": 1, "waiting": 0, "max_concurrent": 8, "state": "unloaded"}}]
    by_id = {e["id"]: e for e in peers.listing(local, 1)}
    assert by_id["m"]["specgate"] == {"running": 2, "waiting": 2, "max_concurrent": 14, "state": "ready"}
    assert by_id["only-a"]["specgate"]["state"] == "loading"
    a.mark_down("gone")
    by_id = {e["id"]: e for e in peers.listing([], 1)}
    assert by_id["only-a"]["specgate"]["state"] == "down"  # still listed: requests get a 503
    assert by_id["m"]["specgate"]["state"] == "unloaded"


def test_relayed_stream_drops_only_the_usage_chunk_asked_for_the_client():
    relayed = Relayed("openai", drop_usage_chunk=True)
    text = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
    assert relayed.keep(text) and not relayed.keep(usage) and not relayed.ended
    assert relayed.keep(b"data: [DONE]\n\n") and relayed.ended
    assert (relayed.prompt_tokens, relayed.completion_tokens) == (7, 3)
    assert Relayed("openai").keep(usage)  # the client asked for it: kept

    anth = Relayed("anthropic")
    for event in ({"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}},
                  {"type": "message_delta", "usage": {"output_tokens": 9}}):  # fmt: skip
        assert anth.keep(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    assert (anth.prompt_tokens, anth.completion_tokens, anth.ended) == (5, 9, False)
    assert anth.keep(b'event: message_stop\ndata: {"type":"message_stop"}\n\n') and anth.ended

    resp = Relayed("responses")
    resp.keep(b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
              b'"response":{"id":"resp_1"}}\n\n')  # fmt: skip
    assert resp.response_id == "resp_1"
    error = json.loads(resp.error_event("gone").split(b"data: ", 1)[1])
    assert error == {"type": "error", "code": "peer_failed", "message": "gone", "param": None,
                     "sequence_number": 1}  # fmt: skip


def test_peek_reads_only_a_json_object_naming_a_model():
    assert peek(b'{"model": "m", "stream": true}').stream
    assert peek(b'{"model": "m", "previous_response_id": "r"}').previous_response_id == "r"
    for raw in (b"", b"[1]", b'{"model": 3}', b"{", b"[" * 100000):
        assert peek(raw) is None


def test_config_peers():
    ok = parse_config({"peers": [{"name": "mac2", "url": "http://10.0.0.2:8000", "key": "sg-x"}]})
    assert not ok.models and "sg-x" not in repr(ok)  # a front with no model; the key never printed
    for bad, words in (({}, "at least one model"),
                       ({"peers": [{"name": "local", "url": "http://h:1"}]}, "own label"),
                       ({"peers": [{"name": "a", "url": "http://h:1"}] * 2}, "repeated: a"),
                       ({"peers": [{"name": "a", "url": "h:1"}]}, "peers.0.url")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            parse_config(bad)


# -- a front and two peers on loopback -----------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """Peers a and b serve "tiny" (two at once each); a also serves "only-a".
    Both need a key, and know the front by its node key. The front serves
    no model and has its own keys: "alice" (any model), "bob" (only-a),
    "brief" (2 requests a minute)."""
    root = tmp_path_factory.mktemp("peers")
    model = {"path": str(tiny_model), "max_context": 2048, "max_concurrent": 2}
    embedding = build_qwen3_embedding(root / "embedding-model", seed=1)
    started, nodes = [], {}
    try:
        for name in ("a", "b"):
            work = root / name
            work.mkdir()
            node_key = add_key(work / "keys", "front")
            extra = [{"id": "only-a", **model}, {"id": "emb", "path": str(embedding)}] \
                if name == "a" else []
            gw = start_gateway({"auth": {"keys_file": str(work / "keys")},
                                "models": [{"id": "tiny", **model}, *extra]}, work)  # fmt: skip
            started.append(gw)
            gw.node_key = node_key
            nodes[name] = gw
        work = root / "front"
        work.mkdir()
        keys = {"alice": add_key(work / "keys", "alice"),
                "bob": add_key(work / "keys", "bob", models=["only-a"]),
                "brief": add_key(work / "keys", "brief", rpm=2)}  # fmt: skip
        front = start_gateway({
            "auth": {"keys_file": str(work / "keys")},
            "models": [],
            "peers": [{"name": n, "url": g.base_url, "key": g.node_key, "health_interval_s": 0.5,
                       "max_backoff_s": 2} for n, g in nodes.items()],
        }, work)  # fmt: skip
        started.append(front)
        front.keys, front.peers = keys, nodes
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(up(front)) < 2:
            time.sleep(0.2)
        assert up(front) == {"a", "b"}, front.log()
        yield front
    finally:
        for gw in started:
            stop_gateway(gw)


def up(front) -> set[str]:
    text = httpx.get(front.base_url + "/metrics").text
    return {line.split('"')[1] for line in text.splitlines()
            if line.startswith("specgate_peer_up{") and line.endswith(" 1.0")}  # fmt: skip


def client(front, name="alice", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.api, api_key=front.keys[name], max_retries=0, timeout=120, **kw)


def node_of(raw) -> str:
    return raw.headers["x-specgate-node"]


def wait_idle(gw, model="tiny", timeout=20) -> None:
    """Until the node reports nothing running or waiting on `model`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = httpx.get(gw.api + "/models", headers={"Authorization": f"Bearer {gw.node_key}"}).json()
        load = next(m["specgate"] for m in data["data"] if m["id"] == model)
        if load["running"] == 0 and load["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{gw.base_url} still busy: {load}")


def test_peer_models_are_listed_and_served_unchanged(cluster):
    front = cluster
    alice = client(front)
    assert {m.id for m in alice.models.list()} == {"tiny", "only-a", "emb"}
    assert [m.id for m in client(front, "bob").models.list()] == ["only-a"]

    msgs = [{"role": "user", "content": "Write a loop in Python."}]
    raw = alice.chat.completions.with_raw_response.create(model="tiny", messages=msgs,
                                                           max_tokens=24, temperature=0)  # fmt: skip
    via_front = raw.parse()
    served_by = front.peers[node_of(raw)]
    direct = openai.OpenAI(base_url=served_by.api, api_key=served_by.node_key, max_retries=0)
    assert via_front.choices[0].message.content == direct.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=24, temperature=0).choices[0].message.content
    assert raw.headers["x-specgate-plan"].startswith("method=")  # the peer's headers come back
    assert via_front.usage.completion_tokens == 24
    # One access line on each side: the front's names the node, the peer's
    # (its id passed on under another name) the decoding.
    at_front = line_of(front, raw.headers["x-request-id"])
    assert (at_front["key"], at_front["model"], at_front["node"]) == ("alice", "tiny", node_of(raw))
    assert at_front["completion_tokens"] == "24" and int(at_front["prompt_tokens"]) > 0
    at_peer = line_of(served_by, raw.headers["x-specgate-peer-request-id"])
    assert (at_peer["key"], at_peer["completion_tokens"], at_peer["status"]) == ("front", "24", "200")
    assert "node" not in at_peer and at_peer["plan"]

    streamed = alice.chat.completions.create(model="tiny", messages=msgs, max_tokens=24,
                                             temperature=0, stream=True)  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        via_front.choices[0].message.content
    assert all(c.choices for c in chunks)  # the usage chunk asked for the quota is not passed on

    only_a = alice.completions.with_raw_response.create(model="only-a", prompt="def f(", max_tokens=4)
    assert node_of(only_a) == "a"

    claude = anthropic.Anthropic(base_url=front.base_url, api_key=front.keys["alice"], max_retries=0)
    message = claude.messages.create(model="tiny", max_tokens=24, messages=msgs, extra_body={"temperature": 0})
    assert message.content[0].text == via_front.choices[0].message.content
    with claude.messages.stream(model="tiny", max_tokens=24, messages=msgs, extra_body={"temperature": 0}) as s:
        assert s.get_final_message().content[0].text == message.content[0].text
    assert claude.messages.count_tokens(model="tiny", messages=msgs).input_tokens > 0

    # The Responses API: a continuation finds the node that holds its start.
    first = alice.responses.create(model="tiny", input="Name a colour.", max_output_tokens=8)
    for _ in range(3):
        again = alice.responses.with_raw_response.create(
            model="tiny", previous_response_id=first.id, input="And another.", max_output_tokens=8)
        assert again.parse().status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):  # another key does not see alice's responses
        client(front, "brief").responses.create(model="tiny", previous_response_id=first.id,
                                                input="Mine?", max_output_tokens=4)  # fmt: skip


def test_embeddings_are_relayed_to_the_peer_that_serves_them(cluster):
    front = cluster
    raw = client(front).embeddings.with_raw_response.create(model="emb", input=["a", "bc"])
    assert node_of(raw) == "a"
    peer = front.peers["a"]
    direct = openai.OpenAI(base_url=peer.api, api_key=peer.node_key, max_retries=0)
    want = direct.embeddings.create(model="emb", input=["a", "bc"])
    assert [d.embedding for d in raw.parse().data] == [d.embedding for d in want.data]
    assert line_of(front, raw.headers["x-request-id"])["node"] == "a"


def test_keys_are_checked_at_the_front(cluster):
    front = cluster
    for key in (None, "sg-00000000.wrong", front.peers["a"].node_key):  # a peer's key means nothing here
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(front.api + "/chat/completions", headers=headers,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(front.api + "/messages", json={"model": "tiny", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["type"] == "error"  # Anthropic's shape

    with pytest.raises(openai.PermissionDeniedError, match="may not use model 'tiny'"):
        client(front, "bob").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client(front).chat.completions.create(
            model="nowhere", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    brief = client(front, "brief")
    for _ in range(2):
        brief.completions.create(model="tiny", prompt="x", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:  # the front's quota, before any peer is asked
        brief.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert int(e.value.response.headers["retry-after"]) >= 1

    # The peers saw only the front's node key, never the clients'.
    for peer in front.peers.values():
        text = httpx.get(peer.base_url + "/metrics").text
        keys = {line.split('key="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("specgate_key_requests_total{")}  # fmt: skip
        assert keys <= {"front"}, keys


def long_stream(front, started: threading.Event, headers: dict, node: list, stop: threading.Event,
                model="tiny"):  # fmt: skip
    """A long stream through the front, until `stop`; its node goes in `node`."""
    with httpx.stream("POST", front.api + "/completions", timeout=120, json={
            "model": model, "prompt": "Count:", "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True},
            headers={"Authorization": f"Bearer {front.keys['alice']}"} | headers) as r:
        node.append(r.headers["x-specgate-node"])
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                break


def test_least_loaded_routing_across_two_peers(cluster):
    front = cluster
    alice = client(front)
    for gw in front.peers.values():
        wait_idle(gw)
    time.sleep(1.2)  # a health check that sees them idle

    # Idle both: the tie goes by name. One stream in flight on a: the next goes to b.
    started, stop, first = threading.Event(), threading.Event(), []
    t = threading.Thread(target=long_stream, args=(front, started, {}, first, stop))
    t.start()
    try:
        assert started.wait(60)
        assert first == ["a"]
        raw = alice.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
        assert node_of(raw) == "b"
    finally:
        stop.set()
        t.join(60)

    # Load from clients that go to a peer directly counts too, once a check has seen it.
    wait_idle(front.peers["a"])
    b = front.peers["b"]
    direct = openai.OpenAI(base_url=b.api, api_key=b.node_key, max_retries=0, timeout=120)
    streams = [direct.completions.create(model="tiny", prompt="Count:", max_tokens=1500,
                                         stream=True, extra_body={"ignore_eos": True})
               for _ in range(2)]  # fmt: skip
    try:
        for s in streams:
            next(iter(s))
        time.sleep(1.2)
        for _ in range(3):
            raw = alice.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
            assert node_of(raw) == "a"
    finally:
        for s in streams:
            s.close()
    routed = httpx.get(front.base_url + "/metrics").text
    assert 'specgate_routed_requests_total{model="tiny",node="b"}' in routed


def test_a_client_that_leaves_stops_the_peers_work(cluster):
    front = cluster
    started, stop, node = threading.Event(), threading.Event(), []
    t = threading.Thread(target=long_stream, args=(front, started, {}, node, stop))
    t.start()
    assert started.wait(60)
    stop.set()  # the client closes its connection to the front
    t.join(60)
    wait_idle(front.peers[node[0]], timeout=2)  # 1500 tokens take longer than that


@pytest.fixture
def draining_peer():
    """FAILURE INJECTION: a fake peer that lists "tiny" as idle and answers
    every request as a specgate shutting down does (503 with its header)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from specgate.gateway.serving.generation import shutting_down

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model",
                             "specgate": {"running": 0, "waiting": 0, "max_concurrent": 8,
                                          "state": "ready"}}]})  # fmt: skip

    async def refuse(request):
        return shutting_down().response()

    app = Starlette(routes=[Route("/v1/models", models),
                            Route("/v1/completions", refuse, methods=["POST"])])  # fmt: skip
    with serve_in_process(app) as url:
        yield url


def test_a_peer_shutting_down_is_passed_over(cluster, draining_peer, tmp_path):
    """A front whose first choice answers "shutting down" sends the request on
    to the next node (its checks, 60 s apart, have not seen the drain yet)."""
    b = cluster.peers["b"]
    front = start_gateway({"models": [], "peers": [
        {"name": "a-draining", "url": draining_peer, "health_interval_s": 60},
        {"name": "b", "url": b.base_url, "key": b.node_key, "health_interval_s": 60}]}, tmp_path)
    try:
        deadline = time.monotonic() + 20
        while len(up(front)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        raw = openai.OpenAI(base_url=front.api, api_key="none", max_retries=0).completions \
            .with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
        assert node_of(raw) == "b" and raw.parse().usage.completion_tokens == 2
        metrics = httpx.get(front.base_url + "/metrics").text
        assert 'specgate_peer_requests_total{model="tiny",node="a-draining",outcome="unreachable"} 1.0' in metrics
        assert 'specgate_peer_up{node="a-draining"} 0.0' in metrics
    finally:
        stop_gateway(front)


def test_a_peer_killed_mid_stream(cluster):
    front = cluster
    alice = client(front)
    for gw in front.peers.values():
        wait_idle(gw)
    time.sleep(1.2)
    stream = alice.completions.with_raw_response.create(
        model="tiny", prompt="Count:", max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    victim = node_of(stream)
    assert victim == "a"  # both idle: the tie goes by name
    got = []
    with pytest.raises(openai.APIError, match=f"peer {victim} failed mid-stream"):
        for chunk in stream.parse():
            got.append(chunk)
            if len(got) == 3:
                gw = front.peers[victim]
                os.killpg(gw.process.pid, signal.SIGKILL)
                gw.process.wait()
    assert all(c.choices[0].finish_reason is None for c in got)  # never claimed to finish

    # The next requests go to the other peer at once.
    other = ({"a", "b"} - {victim}).pop()
    for _ in range(2):
        raw = alice.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
        assert node_of(raw) == other
    metrics = httpx.get(front.base_url + "/metrics").text
    assert f'specgate_peer_up{{node="{victim}"}} 0.0' in metrics
    assert f'specgate_peer_requests_total{{model="tiny",node="{victim}",outcome="failed"}} 1.0' in metrics

    if victim == "a":  # only a served it: a clear 503 in each API's shape
        with pytest.raises(openai.InternalServerError, match="served by a, down now"):
            alice.completions.create(model="only-a", prompt="x", max_tokens=2)
        claude = anthropic.Anthropic(base_url=front.base_url, api_key=front.keys["alice"],
                                     max_retries=0)  # fmt: skip
        with pytest.raises(anthropic.APIStatusError) as e:
            claude.messages.create(model="only-a", max_tokens=2,
                                   messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 503 and e.value.body["type"] == "error"
    assert httpx.get(front.base_url + "/ready").status_code == 200  # the other peer still serves
