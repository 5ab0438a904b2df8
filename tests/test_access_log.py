"""The access log (gateway/access/access_log.py) of a real `specgate serve`:
one line per request, written when its response has ended, read back from
the server's log as a log shipper or `grep` would, with the real openai SDK."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway

from specgate.engines.registry import methods as known_methods
from specgate.gateway.access.keys import add_key

LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) specgate\.access: (?P<pairs>.*)$")
PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
ORDER = ["id", "client", "key", "method", "path", "api", "model", "node", "plan", "prompt_tokens",
         "cached_tokens", "completion_tokens", "ttft_s", "decode_tok_s", "duration_s", "status",
         "outcome"]  # fmt: skip


def access_lines(log: str) -> list[dict]:
    """Each access line as its fields (a quoted value unquoted), and `level`."""
    out = []
    for line in log.splitlines():
        if m := LINE.match(line):
            pairs = [(k, json.loads(v) if v.startswith('"') else v)
                     for k, v in PAIR.findall(m["pairs"])]  # fmt: skip
            assert " ".join(f"{k}={v}" for k, v in PAIR.findall(m["pairs"])) == m["pairs"], line
            keys = [k for k, _ in pairs]
            assert keys == [k for k in ORDER if k in keys], line  # a stable order
            out.append(dict(pairs, level=m["level"]))
    return out


def line_of(gw, request_id: str) -> dict:
    """The one access line of this request; it is written just after the
    response's last byte, so it is waited for."""
    deadline = time.monotonic() + 10
    while True:
        found = [f for f in access_lines(gw.log()) if f["id"] == request_id]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(found) == 1, (request_id, found, gw.log()[-3000:])
    return found[0]


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    """Keys "alice" and "reader"; logging at debug, to see where scrapes go."""
    work = tmp_path_factory.mktemp("access-log")
    keys_file = work / "keys"
    keys = {name: add_key(keys_file, name) for name in ("alice", "reader")}
    gw = start_gateway({
        "server": {"log_level": "debug"},
        "auth": {"keys_file": str(keys_file), "metrics_requires_key": True},
        "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048}],
    }, work)
    gw.keys = keys
    yield gw
    stop_gateway(gw)


def client(gw, name: str = "alice", key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.api, api_key=key or gw.keys[name], max_retries=0, timeout=60)


ASK = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}],
       "max_tokens": 8, "extra_body": {"ignore_eos": True}}  # fmt: skip


def test_a_request_is_one_line_with_every_field(gw):
    raw = client(gw).chat.completions.with_raw_response.create(**ASK)
    usage = raw.parse().usage
    request_id = raw.headers["x-request-id"]
    f = line_of(gw, request_id)
    assert (f["level"], f["client"], f["key"], f["method"], f["path"], f["api"], f["model"]) == (
        "INFO", "127.0.0.1", "alice", "POST", "/v1/chat/completions", "openai", "tiny")
    assert f["plan"] in known_methods()
    assert raw.headers["x-specgate-plan"].startswith(f"method={f['plan']};")
    assert int(f["prompt_tokens"]) == usage.prompt_tokens
    assert int(f["cached_tokens"]) == usage.prompt_tokens_details.cached_tokens
    assert int(f["completion_tokens"]) == usage.completion_tokens == 8
    ttft, duration = float(f["ttft_s"]), float(f["duration_s"])
    assert 0 < ttft <= duration and float(f["decode_tok_s"]) > 0
    assert (f["status"], f["outcome"]) == ("200", "ok")
    assert gw.keys["alice"] not in gw.log()  # the name, never the key


def test_a_stream_is_one_line_when_it_ends(gw):
    raw = client(gw).chat.completions.with_raw_response.create(
        **ASK, stream=True, stream_options={"include_usage": True})
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    f = line_of(gw, raw.headers["x-request-id"])
    assert (f["path"], f["key"], f["status"], f["outcome"]) == ("/v1/chat/completions", "alice",
                                                                "200", "ok")  # fmt: skip
    assert int(f["prompt_tokens"]) == usage.prompt_tokens
    assert int(f["completion_tokens"]) == usage.completion_tokens == 8
    assert float(f["ttft_s"]) <= float(f["duration_s"]) and "decode_tok_s" in f


def test_a_wrong_key_is_one_line_with_its_401(gw):
    wrong = "sg-00000000.wrong-key-sent-by-a-client-WRONGKEYSECRET"
    with pytest.raises(openai.AuthenticationError) as err:
        client(gw, key=wrong).chat.completions.create(**ASK)
    f = line_of(gw, err.value.response.headers["x-request-id"])
    assert (f["key"], f["status"], f["outcome"], f["api"]) == ("-", "401", "rejected", "openai")
    assert "model" not in f and "WRONGKEYSECRET" not in gw.log()
    # /metrics's per-key series are named by configured keys only: what a
    # refused client sent never becomes a label.
    exposition = httpx.get(gw.base_url + "/metrics",
                           headers={"Authorization": f"Bearer {gw.keys['reader']}"}).text
    labels = set(re.findall(r'^specgate_key_\w+\{key="([^"]*)"', exposition, re.M))
    assert labels and labels <= {"alice", "reader"}, labels
    assert "WRONGKEYSECRET" not in exposition


def test_a_client_leaving_mid_stream_is_one_cancelled_line(gw):
    with httpx.stream("POST", gw.api + "/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {gw.keys['alice']}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "count"}],
                            "max_tokens": 1900, "stream": True, "ignore_eos": True}) as resp:  # fmt: skip
        request_id = resp.headers["x-request-id"]
        lines = resp.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    f = line_of(gw, request_id)
    assert (f["status"], f["outcome"], f["model"]) == ("200", "cancelled", "tiny")
    assert 0 < int(f["completion_tokens"]) < 1900


def test_scrapes_and_health_checks_are_debug_lines(gw):
    scrape = httpx.get(gw.base_url + "/metrics",
                       headers={"Authorization": f"Bearer {gw.keys['reader']}"})  # fmt: skip
    health = httpx.get(gw.base_url + "/health")
    head = httpx.head(gw.base_url + "/")
    # The admin page polls its data every 2 s while it is open.
    poll = httpx.get(gw.base_url + "/admin/status",
                     headers={"Authorization": f"Bearer {gw.keys['reader']}"})  # fmt: skip
    for r, path, api, key in ((scrape, "/metrics", "metrics", "reader"),
                              (health, "/health", "health", "-"), (head, "/", "ui", "-"),
                              (poll, "/admin/status", "admin", "reader")):
        f = line_of(gw, r.headers["x-request-id"])
        assert (f["level"], f["path"], f["api"], f["key"], f["status"]) == ("DEBUG", path, api,
                                                                            key, "200")  # fmt: skip
    assert not [f for f in access_lines(gw.log()) if f["level"] == "INFO"
                and f["path"] in ("/metrics", "/health", "/ready", "/admin/status")]  # fmt: skip


def test_a_path_is_quoted_on_its_one_line(gw):
    """A client's path (decoded: a newline, a space, a quote) stays within
    its line's one value."""
    r = httpx.get(gw.api + "/no%20such%0Aroute%22x=1",
                  headers={"Authorization": f"Bearer {gw.keys['alice']}"})  # fmt: skip
    assert r.status_code == 404
    f = line_of(gw, r.headers["x-request-id"])
    assert f["path"] == '/v1/no such\nroute"x=1' and f["outcome"] == "rejected"
    assert not re.search(r"^route", gw.log(), re.M)


def test_json_log_format_makes_every_line_json(tiny_model, tmp_path):
    """`server.log_format: json` (or --log-format json): every line an object,
    an access line's fields as its keys; an open server's key is "anonymous"."""
    gw = start_gateway({"server": {"log_format": "json"},
                        "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048}]},
                       tmp_path)  # fmt: skip
    try:
        raw = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0).chat.completions \
            .with_raw_response.create(**ASK)  # fmt: skip
        request_id = raw.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while request_id not in gw.log() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop_gateway(gw)
    lines = [json.loads(line) for line in gw.log().splitlines()]  # each one parses
    access = [entry for entry in lines if entry.get("id") == request_id]
    assert len(access) == 1, lines[-5:]
    a = access[0]
    assert {k: a[k] for k in ("level", "logger", "key", "method", "path", "api", "model", "status",
                              "outcome", "completion_tokens")} == {
        "level": "INFO", "logger": "specgate.access", "key": "anonymous", "method": "POST",
        "path": "/v1/chat/completions", "api": "openai", "model": "tiny", "status": 200,
        "outcome": "ok", "completion_tokens": 8}  # fmt: skip
    assert a["ttft_s"] <= a["duration_s"] and a["time"].endswith("+00:00")
    others = [entry for entry in lines if entry.get("logger") != "specgate.access"]
    assert others and all({"time", "level", "logger", "message"} <= e.keys() for e in others)
    assert any(e["logger"].startswith("uvicorn") for e in others)  # uvicorn's lines too
