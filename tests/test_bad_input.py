"""Every bad input gets its status and an OpenAI-shaped error; the server keeps serving."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

CHAT, COMP = "/chat/completions", "/completions"
MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": "tiny", "messages": MSGS, "max_tokens": 4, **kw}


def comp(**kw):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **kw}


# (endpoint, body, status, param the error must name, or None)
CASES = {
    "unknown model": (CHAT, chat(model="no-such-model"), 404, "model"),
    "negative max_tokens": (CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    "zero max_completion_tokens": (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    "temperature < 0": (CHAT, chat(temperature=-0.5), 400, "temperature"),
    "temperature > 2": (CHAT, chat(temperature=7), 400, "temperature"),
    "top_p > 1": (CHAT, chat(top_p=1.5), 400, "top_p"),
    "top_p = 0": (COMP, comp(top_p=0), 400, "top_p"),
    "min_p > 1": (COMP, comp(min_p=2), 400, "min_p"),
    "top_k < -1": (COMP, comp(top_k=-3), 400, "top_k"),
    "presence_penalty out of range": (CHAT, chat(presence_penalty=9), 400, "presence_penalty"),
    "repetition_penalty 0": (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    "top_logprobs > 20": (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    "huge stop list": (CHAT, chat(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    "huge stop string": (COMP, comp(stop="x" * 5000), 400, "stop"),
    "stop of wrong type": (COMP, comp(stop=5), 400, "stop"),
    "messages not a list": (CHAT, chat(messages="hi"), 400, "messages"),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages"),
    "unknown role": (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    "image content": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, None),
    "max_tokens as string": (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    "missing model": (COMP, {"prompt": "hi"}, 400, "model"),
    "n > 1": (CHAT, chat(n=3), 400, "n"),
    "tools (not yet supported)": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, None),
    "prompt batch": (COMP, comp(prompt=["a", "b"]), 400, None),
    "empty prompt": (COMP, comp(prompt=""), 400, "prompt"),
    "token id outside vocabulary": (COMP, comp(prompt=[1, 2, 10**7]), 400, "prompt"),
    "prompt longer than context": (COMP, comp(prompt=[5] * 3000), 400, "prompt"),
    "chat longer than context": (CHAT, chat(messages=[{"role": "user", "content": "word " * 5000}]), 400, None),
}


def assert_openai_error(resp: httpx.Response, status: int, param: str | None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"type", "param", "code"} <= set(err)
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_body(gateway, case):
    path, body, status, param = CASES[case]
    assert_openai_error(httpx.post(gateway.api + path, json=body, timeout=30), status, param)


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "tiny", "prompt": "\xff\xfe"}', b"", b"[]", b"null"])
def test_malformed_bodies(gateway, raw):
    resp = httpx.post(gateway.api + COMP, content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, None)


def test_body_too_large(gateway):
    big = comp(prompt="x" * (300 * 1024))  # the test gateway allows 256 KiB
    assert_openai_error(httpx.post(gateway.api + COMP, json=big, timeout=30), 413, None)

    def chunked():
        for _ in range(40):
            yield b" " * 8192
        yield b"{}"

    resp = httpx.post(gateway.api + COMP, content=chunked(), timeout=30,
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, 413, None)


def test_stalled_body_times_out(gateway):
    """A client that stops sending its body gets a 408 after the server's
    body_timeout_s (2 s in the test gateway) and its connection closed."""
    host, port = gateway.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"model\": ")  # fmt: skip
        t0 = time.monotonic()
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        waited = time.monotonic() - t0
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert 1.5 < waited < 20


@pytest.mark.parametrize("headers,needle", [
    ({"X-Specgate-Method": "warp-drive"}, "unknown method"),
    ({"X-Specgate-Method": "dflash"}, "available: none"),
    ({"X-Specgate-Depth": "many"}, "integer"),
    ({"X-Specgate-Depth": "3"}, "speculative method"),
])
def test_bad_override_headers(gateway, headers, needle):
    resp = httpx.post(gateway.api + CHAT, json=chat(), headers=headers, timeout=30)
    assert_openai_error(resp, 400, None)
    assert needle in resp.json()["error"]["message"]


def test_sdk_sees_typed_errors(gateway):
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSGS, temperature=-1)
    assert err.value.body["param"] == "temperature"


def test_still_serving_after_all_that(gateway):
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
    assert out.usage.completion_tokens >= 1
    assert gateway.alive()
    assert "Traceback" not in gateway.log()


@pytest.mark.parametrize("path,raw,param", [
    (COMP, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages.0.content"),
    ("/messages", b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                  b'"content": [{"type": "text", "text": "x\\ud83d"}]}]}', "messages.0.content.0.text"),
])
def test_lone_surrogates_are_a_400_naming_the_field(gateway, path, raw, param):
    """JSON may escape a lone UTF-16 surrogate; it is no text (a tokenizer fails on it)."""
    resp = httpx.post(gateway.api + path, content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "surrogate" in message and param in message


def test_oversized_headers_get_431_and_the_server_keeps_serving(gateway):
    host, port = gateway.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        reply = b""
        try:
            for _ in range(64):  # 4 MB of one header, in pieces, unless cut off first
                sock.sendall(b"x-junk: " + b"a" * 65536 + b"\r\n")
        except OSError:
            pass  # the server closed the connection mid-send: what we want
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), reply[:200]
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    # Headers under the limit are fine, and the server still answers.
    ok = httpx.get(gateway.base_url + "/health", headers={"x-big": "b" * 30000}, timeout=30)
    assert ok.status_code == 200


# -- object keys and nesting: every API, whole and streamed -----------------------------------------

S = "\ud800"  # json.dumps writes it as the escape "\ud800"; the server decodes a lone surrogate
USER = {"role": "user", "content": "hi"}


def nested_text(depth: int) -> str:
    """JSON text of objects `depth` deep (json.dumps itself cannot write 2,000)."""
    return '{"a": ' * depth + "1" + "}" * depth


def nested(depth: int) -> str:
    """Stands for nested_text(depth) inside a body; `encoded` puts it there."""
    return f"<nested {depth}>"


def encoded(body: dict) -> bytes:
    text = json.dumps(body)
    return re.sub(r'"<nested (\d+)>"', lambda m: nested_text(int(m.group(1))), text).encode()


def chat_call(arguments: str) -> dict:
    """A chat with a tool call in its history, `arguments` its JSON text."""
    return chat(messages=[USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])  # fmt: skip


def responses_call(arguments: str) -> dict:
    return {"model": "tiny", "max_output_tokens": 2, "input": [
        USER, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}  # fmt: skip


def messages_call(tool_input: object) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [
        USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": tool_input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}


PROPERTY = {"type": "object", "properties": {f"city{S}": {"type": "string"}}}
# (path, body, what the message must name, and say)
KEYS_AND_DEPTH = {
    "surrogate: a tool's property name": (CHAT, chat(tools=[
        {"type": "function", "function": {"name": "f", "parameters": PROPERTY}}]),
        "tools.0.function.parameters.properties", "surrogate"),
    "surrogate: a message's key": (CHAT, chat(messages=[USER | {f"x{S}": 1}]), "messages.0", "surrogate"),
    "surrogate: a response_format schema's property": (CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": PROPERTY}}),
        "response_format.json_schema.schema.properties", "surrogate"),
    "surrogate: a chat tool call's arguments": (CHAT, chat_call(json.dumps({S: 1})),
        "messages.1.tool_calls.0.function.arguments", "surrogate"),
    "surrogate: a Responses metadata key": (
        "/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "metadata": {S: "x"}},
        "metadata", "surrogate"),
    "surrogate: a Responses tool's property name": ("/responses", {
        "model": "tiny", "input": "hi", "max_output_tokens": 2,
        "tools": [{"type": "function", "name": "f", "parameters": PROPERTY}]},
        "tools.0.parameters.properties", "surrogate"),
    "surrogate: a Responses function_call's arguments": (
        "/responses", responses_call(json.dumps({S: 1})), "input.1.function_call.arguments", "surrogate"),
    "surrogate: an Anthropic tool_use input key": (
        "/messages", messages_call({S: 1}), "messages.1.content.0.input", "surrogate"),
    "surrogate: an Anthropic tool's input_schema property": ("/messages", {
        "model": "tiny", "max_tokens": 2, "messages": [USER],
        "tools": [{"name": "f", "input_schema": PROPERTY}]},
        "tools.0.input_schema.properties", "surrogate"),
    "surrogate: count_tokens": ("/messages/count_tokens", {
        "model": "tiny", "messages": [USER], "tools": [{"name": "f", "input_schema": PROPERTY}]},
        "tools.0.input_schema.properties", "surrogate"),
    "depth: chat tool call arguments, 2,000 deep": (
        CHAT, chat_call(nested_text(2000)), "messages.1.tool_calls.0.function.arguments", "nested"),
    "depth: chat tool call arguments, 65 deep": (
        CHAT, chat_call(nested_text(65)), "messages.1.tool_calls.0.function.arguments", "nested"),
    "depth: Responses function_call arguments, 2,000 deep": (
        "/responses", responses_call(nested_text(2000)), "input.1.function_call.arguments",
        "nested"),
    "depth: Anthropic tool_use input, 800 deep": (
        "/messages", messages_call(nested(800)), "messages.1.content.0.input", "nested"),
    "depth: Anthropic tool_use input, 2,000 deep (past what json.loads parses)": (
        "/messages", messages_call(nested(2000)), "request body", "nested"),
    "depth: a chat tool's parameters, 200 deep": (CHAT, chat(tools=[
        {"type": "function", "function": {"name": "f", "parameters": nested(200)}}]),
        "tools.0.function.parameters", "nested"),
}  # fmt: skip


@pytest.mark.parametrize("case,stream", [
    pytest.param(case, stream, id=f"{case}-{'streamed' if stream else 'whole'}")
    for case, (path, *_) in KEYS_AND_DEPTH.items()
    for stream in ((False,) if path.endswith("count_tokens") else (False, True))])
def test_bad_keys_and_deep_nesting_are_a_400_naming_the_field(gateway, case, stream):
    """A lone surrogate in an object's key, or JSON nested past 64 levels,
    anywhere a body holds a mapping (or JSON text of one), is the client's
    400 in the API's own shape, before any byte of a stream; never a 500."""
    path, body, where, says = KEYS_AND_DEPTH[case]
    if stream:
        body = body | {"stream": True}
    resp = httpx.post(gateway.api + path, content=encoded(body), timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text[:500]
    assert resp.headers["content-type"] == "application/json"
    shape = {"type", "error"} if path.startswith("/messages") else {"error"}
    assert set(resp.json()) == shape
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert says in error["message"] and where in error["message"], error
