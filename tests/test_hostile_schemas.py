"""Schemas, tools and prompts a hostile client sends, through a real server.

Each case here once crashed the gateway, froze its event loop for every
client, or came back as a 5xx or an error after the stream had started
(issue 40): a `$ref` chain that overflowed the grammar compiler's C stack
(the process died), self- and mutually-recursive `$ref`s and wide schemas
(500s, or an error at the first streamed token with the compiler's
internals in it), an XML-format tool with a 100k-value enum and a 4 MB
count_tokens (the loop blocked for tens of seconds). Now each is a 400 in
the API's own shape before anything streams, and the server keeps serving.
"""

from __future__ import annotations

import threading

import anthropic
import httpx
import openai
import pytest
from tool_caller import tiny_and_xml

from tests.conftest import start_gateway, stop_gateway


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    config = tiny_and_xml(tiny_model, tmp_path_factory.mktemp("xml"), 2048, 8 << 20)
    gw = start_gateway(config, tmp_path_factory.mktemp("hostile-schemas"))
    yield gw
    stop_gateway(gw)


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def prop_chain(n: int) -> dict:
    """n objects, each the next one's only property: under every width bound,
    and deeper than the compiler's stack holds at n ~ 1000."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def properties(n: int, required: bool) -> dict:
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props} | ({"required": list(props)} if required else {})


BOMBS = {
    "ref-chain-3000": ref_chain(3000),  # killed the process (C stack overflow)
    "prop-chain-999": prop_chain(999),  # so did this
    "self-ref": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "mutual-ref": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        "$ref": "#/$defs/a",
    },  # fmt: skip
    "10k-optional": properties(10_000, required=False),
    "10k-required": properties(10_000, required=True),
    "anyOf-5000": {"anyOf": [{"const": f"v{i}"} for i in range(5000)]},
    "remote-ref": {"$ref": "http://169.254.169.254/latest/meta-data"},
}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", list(BOMBS))
def test_schema_bombs_are_a_400_before_anything_streams(server, name, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": stream, "response_format": response_format(BOMBS[name])}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      timeout=60) as r:  # fmt: skip
        r.read()
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_schema"
    assert "<state>" not in error["message"] and len(error["message"]) < 600
    assert server.alive()


def test_every_api_refuses_a_bomb_in_its_own_shape(server):
    chain = prop_chain(999)
    tool = {"type": "function", "function": {"name": "f", "parameters": chain}}
    oa = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # a forced call to a tool with that schema
        oa.chat.completions.create(model="xml", messages=[{"role": "user", "content": "hi"}],
                                   tools=[tool], tool_choice="required", max_tokens=4)  # fmt: skip
    assert e.value.body["param"] == "tool_choice" and "nests deeper" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="tiny", input="hi", max_output_tokens=4,
                            text={"format": {"type": "json_schema", "name": "o", "schema": chain}})  # fmt: skip
    assert "nests deeper" in e.value.body["message"]
    an = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="xml", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                           tools=[{"name": "f", "input_schema": chain}], tool_choice={"type": "any"})  # fmt: skip
    assert e.value.body["type"] == "error" and "nests deeper" in e.value.body["error"]["message"]
    assert server.alive()


def test_a_huge_enum_in_an_xml_tool_is_refused_and_a_large_one_served(server):
    def tool(n):
        return {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"v": {"type": "string", "enum": [f"v{i}" for i in range(n)]}},
            "required": ["v"]}}}  # fmt: skip

    oa = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
    ask = {"model": "xml", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
           "tool_choice": "required"}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:  # blocked the loop for 37 s
        oa.chat.completions.create(tools=[tool(100_000)], **ask)
    assert "100000 entries" in e.value.body["message"]
    done = oa.chat.completions.create(tools=[tool(300)], **ask)  # within the bounds: served
    assert done.choices[0].finish_reason in ("tool_calls", "length")


def test_a_huge_count_tokens_does_not_stall_other_clients(server):
    """4 MB to count: it runs on the CPU workers, and /v1/models answers
    meanwhile (on the event loop it held every client for seconds)."""
    text = "the quick brown fox jumps over the lazy dog 0123456789 " * 73_000
    result: dict = {}

    def count():
        an = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=300)  # fmt: skip
        result["tokens"] = an.messages.count_tokens(
            model="tiny", messages=[{"role": "user", "content": text}]).input_tokens  # fmt: skip

    worker = threading.Thread(target=count)
    worker.start()
    answered_meanwhile = 0
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        while worker.is_alive():
            if client.get("/v1/models").status_code == 200 and worker.is_alive():
                answered_meanwhile += 1
    worker.join()
    assert result["tokens"] > len(text) // 20
    # Counting takes seconds here; on the event loop, the only answers were
    # those before the upload ended (a handful at most).
    assert answered_meanwhile >= 20, "/v1/models waited for the count"


def test_still_serving(server):
    oa = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    done = oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        response_format=response_format({"type": "object", "properties": {"a": {"type": "string"}}}),
    )  # fmt: skip
    assert done.choices[0].message.content.startswith("{")
    assert server.alive()
