"""A fuzz tier for what strangers send: generated deep and wide schemas,
tools and messages, through a real server, in every API's shape.

tests/test_fuzz.py fuzzes from specgate's own OpenAPI schema, so it sends
what the schema describes; this one sends what a hostile client would:
JSON schemas nested thousands deep or wide, `$ref`s that loop, dangle or
point off the document, tools built from them (forced and not), and
messages whose tool-call arguments nest deep or carry odd keys. Checks: no
answer is a 5xx, a 200 stream carries no error event, and the process
is alive and serving at the end. The fast tier runs a fixed-seed sample;
`-m proof` runs many more.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tool_caller import tiny_and_xml

from tests.conftest import start_gateway, stop_gateway


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    config = tiny_and_xml(tiny_model, tmp_path_factory.mktemp("xml"), 4096, 4 << 20)
    gw = start_gateway(config, tmp_path_factory.mktemp("fuzz-hostile"))
    # A connection per request: the server closes an idle keep-alive one after
    # 5 s, and hypothesis can take that long to build a case.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=gw.base_url, timeout=120, limits=limits) as client:
        gw.client = client
        yield gw
    stop_gateway(gw)


# -- what a hostile client builds -------------------------------------------------

NAMES = st.one_of(st.sampled_from(["a", "b", "x", "$ref", "properties", "", "~1/"]),
                  st.text(max_size=8))  # fmt: skip
REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/b", "#/$defs/missing", "#/properties",
                        "http://127.0.0.1:1/x.json", "#/$defs/a/properties/x", "", 7])  # fmt: skip
LEAVES = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null",
                                          "object", "array", "no-such-type")]),  # fmt: skip
    st.builds(lambda r: {"$ref": r}, REFS),
    st.builds(lambda v: {"enum": v}, st.lists(st.one_of(st.integers(), st.text(max_size=4)), max_size=5)),
    st.builds(lambda v: {"const": v}, st.one_of(st.integers(), st.text(max_size=4), st.none())),
    st.just({}), st.just(True), st.just(False),
)  # fmt: skip


def _compound(children):
    return st.one_of(
        st.builds(lambda p, r: {"type": "object", "properties": p, "required": r},
                  st.dictionaries(NAMES, children, max_size=4), st.lists(NAMES, max_size=3)),
        st.builds(lambda i: {"type": "array", "items": i}, children),
        st.builds(lambda k, v: {k: v}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(children, max_size=4)),
        st.builds(lambda n: {"not": n}, children),
    )  # fmt: skip


SCHEMAS = st.recursive(LEAVES, _compound, max_leaves=20)


def deep(n: int, kind: str) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "array", "items": s} if kind == "items" else {"anyOf": [s, {"type": "null"}]}
    return s


def wide(n: int, kind: str) -> dict:
    if kind == "enum":
        return {"enum": [f"v{i}" for i in range(n)]}
    if kind == "anyOf":
        return {"anyOf": [{"const": i} for i in range(n)]}
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def ref_loop(n: int) -> dict:
    """$defs d0 -> d1 -> ... -> d(n-1) -> d0: a loop with nothing between."""
    return {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)},
            "$ref": "#/$defs/d0"}  # fmt: skip


BOMBS = st.one_of(
    st.builds(deep, st.integers(1, 3000), st.sampled_from(["items", "anyOf"])),
    st.builds(wide, st.integers(1, 6000), st.sampled_from(["enum", "anyOf", "properties"])),
    st.builds(ref_loop, st.integers(1, 50)),
)
ANY_SCHEMA = st.one_of(
    SCHEMAS,
    BOMBS,
    st.builds(lambda defs, root: {**root, "$defs": defs} if isinstance(root, dict) else root,
              st.fixed_dictionaries({"a": SCHEMAS, "b": SCHEMAS}), SCHEMAS),
)  # fmt: skip


def nested_args(depth: int) -> dict:
    value: object = 1
    for _ in range(depth):
        value = {"k": value}
    return value  # type: ignore[return-value]


def request_for(
    api: str, schema, forced: bool, stream: bool, history_depth: int
) -> tuple[str, dict]:
    """One request of `api`'s shape carrying the schema, maybe as a forced tool."""
    if api == "chat":
        body: dict = {"model": "xml" if forced else "tiny", "max_tokens": 4, "stream": stream,
                      "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        if history_depth:
            body["messages"] += [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": dumps(nested_args(history_depth)).decode()}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
                {"role": "user", "content": "again"},
            ]  # fmt: skip
        if forced:
            body |= {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                     "tool_choice": "required"}  # fmt: skip
        else:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "o", "schema": schema}}  # fmt: skip
        return "/v1/chat/completions", body
    if api == "messages":
        body = {"model": "xml" if forced else "tiny", "max_tokens": 4, "stream": stream,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": schema}]}  # fmt: skip
        if forced:
            body["tool_choice"] = {"type": "any"}
        return "/v1/messages", body
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "o", "schema": schema}}}  # fmt: skip
    return "/v1/responses", body


def dumps(body: dict) -> bytes:
    """JSON of a body nested thousands deep (json's C encoder counts its
    recursion against Python's limit; what a client in another language
    would send without a second thought)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 50_000))
    try:
        return json.dumps(body).encode()
    finally:
        sys.setrecursionlimit(limit)


def send(server, path: str, body: dict) -> None:
    content = dumps(body)
    with server.client.stream("POST", path, content=content,
                              headers={"content-type": "application/json"}) as r:  # fmt: skip
        raw = r.read()
    assert r.status_code < 500, f"{r.status_code} for {content[:400]!r}: {raw[:400]!r}"
    if r.status_code == 200 and body.get("stream"):
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                failed = event.get("error") or event.get("type") in ("error", "response.failed")
                assert not failed, f"an error after the stream began: {line[:400]}"
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), raw[:200]


CASES = st.tuples(
    st.sampled_from(["chat", "messages", "responses"]),
    ANY_SCHEMA,
    st.booleans(),
    st.booleans(),
    st.sampled_from([0, 0, 0, 50, 2000]),
)


def _fuzz(server, examples: int):
    @seed(40)
    @settings(max_examples=examples, deadline=None, derandomize=False, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(CASES)
    def run(case):
        api, schema, forced, stream, history_depth = case
        send(server, *request_for(api, schema, forced, stream, history_depth))

    run()
    assert server.alive()
    ok = server.client.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert ok.status_code == 200, ok.text


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
@pytest.mark.timeout(600)
def test_hostile_requests_get_4xx_never_5xx(server):
    _fuzz(server, examples=60)


@pytest.mark.proof
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
@pytest.mark.timeout(1200)
def test_hostile_requests_get_4xx_never_5xx_many(server):
    _fuzz(server, examples=600)
