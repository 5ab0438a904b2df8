"""Structured outputs through the gateway, with the real openai SDK.

The shipped demo model (a small code model that knows nothing of JSON),
served with plain decoding, MTP, DFlash and ngram copies: `response_format`
json_schema (strict) gives output that parses and validates on every one
of 20 prompts (8 in the fast tier, 2 a method), whichever method decodes it
(forced per request); greedy,
every method gives the same text as plain decoding; json_object gives an
object; bad schemas and impossible combinations are 400s naming the
parameter.
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from conftest import start_gateway, stop_gateway

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "line": {"type": "integer", "minimum": 1, "maximum": 99999},
        "kind": {"enum": ["function", "class", "module"]},
        "calls": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "public": {"type": "boolean"},
    },
    "required": ["name", "line", "kind", "calls", "public"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "symbol", "schema": SCHEMA, "strict": True}}
METHODS = ["none", "mtp", "dflash", "ngram"]
PROMPTS = [
    f"Describe the Python symbol `{name}` as JSON."
    for name in ("os.path.join", "json.loads", "re.compile", "Counter", "defaultdict", "main",
                 "Stack.push", "deque", "sorted", "open", "Path.read_text", "asyncio.run",
                 "print", "len", "Thread", "Queue.get", "sys.exit", "zip", "ArgumentParser",
                 "functools.partial")
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_gateway(
        {"models": [{"id": "demo", "path": "builtin:demo", "drafter": "builtin:demo-dflash",
                     "engines": ["mlx_plain", "mlx_mtp", "mlx_dflash", "mlx_ngram"],
                     "max_context": 2048}]},
        tmp_path_factory.mktemp("structured"),
    )  # fmt: skip
    yield gw
    stop_gateway(gw)


def ask(client, prompt: str, method: str, **kw):
    return client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": prompt}],
        extra_headers={"X-Specgate-Method": method}, **{"max_tokens": 200} | kw)


# Sampled: the fast tier's 8 prompts give each method 2, the proof tier all 20.
@pytest.mark.parametrize("n", [8, pytest.param(len(PROMPTS), marks=pytest.mark.proof)])
def test_json_schema_strict_always_validates(gateway, n):
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    validator = jsonschema_rs.validator_for(SCHEMA)
    for i, prompt in enumerate(PROMPTS[:n]):
        resp = ask(client, prompt, METHODS[i % len(METHODS)], response_format=FORMAT,
                   temperature=0.8, seed=i)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        assert validator.is_valid(value), (prompt, value)


def test_greedy_is_the_same_through_every_method(gateway):
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    for prompt in PROMPTS[:3]:
        texts = {m: ask(client, prompt, m, response_format=FORMAT, temperature=0)
                 .choices[0].message.content for m in METHODS}  # fmt: skip
        assert len(set(texts.values())) == 1, texts
        assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(texts["none"]))


def test_streamed_json_object(gateway):
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    stream = ask(client, PROMPTS[0], "mtp", response_format={"type": "json_object"},
                 temperature=0, stream=True, max_tokens=400)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    finish = chunks[-1].choices[0].finish_reason
    # Any object: it may run to max_tokens, but what came is an object's start.
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])  # fmt: skip
def test_bad_requests_name_the_parameter(gateway, body, param):
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=body)
    assert (err.value.body["param"] or "").startswith(param), err.value.body
    # ... and the server keeps serving
    # (past an end of text: sampled, the demo model once ended within 2 tokens)
    assert ask(client, "hi", "none", max_tokens=2,
               extra_body={"ignore_eos": True}).choices[0].finish_reason == "length"
