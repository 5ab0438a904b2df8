"""POST /v1/responses with the real openai SDK: text, streamed and not; a
function-call round trip (previous_response_id, and the same items sent
whole); forced calls; text.format json_schema; errors in OpenAI's shape.

Served: the shipped demo model (plain and MTP), and the hand-built
tool-calling checkpoints of tests/tool_caller.py (hermes and XML formats),
whose greedy answer is a known call.
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from conftest import start_gateway, stop_gateway
from test_tools import HERMES_ANSWER, XML_ANSWER
from tool_caller import HERMES_TEMPLATE, XML_TEMPLATE, build_tool_caller

TOOL = {"type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}  # fmt: skip
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses-models")
    gw = start_gateway(
        {"models": [
            {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"],
             "max_context": 2048},
            {"id": "hermes", "path": str(build_tool_caller(root / "h", HERMES_TEMPLATE, HERMES_ANSWER)),
             "max_context": 2048},
            {"id": "xml", "path": str(build_tool_caller(root / "x", XML_TEMPLATE, XML_ANSWER)),
             "max_context": 2048}]},
        tmp_path_factory.mktemp("responses"),
    )  # fmt: skip
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)


def test_text_whole_and_streamed(client):
    kw = dict(model="demo", input="Write a function that adds two numbers.", temperature=0,
              max_output_tokens=24)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 24 and whole.usage.input_tokens > 0
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and whole.output_text

    # The same prompt through chat completions: greedy, the same text.
    chat = client.chat.completions.create(model="demo", temperature=0, max_tokens=24,
                                          messages=[{"role": "user", "content": kw["input"]}])
    assert chat.choices[0].message.content == whole.output_text

    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_instructions_and_items(client):
    a = client.responses.create(model="demo", temperature=0, max_output_tokens=8,
                                instructions="Answer in Python.",
                                input=[{"role": "user", "content": "hello"}])
    b = client.responses.create(model="demo", temperature=0, max_output_tokens=8, input=[
        {"type": "message", "role": "developer", "content": "Answer in Python."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}])
    assert a.output_text == b.output_text and a.usage.input_tokens == b.usage.input_tokens


@pytest.mark.parametrize("model", ["hermes", "xml"])
def test_function_call_round_trip(client, model):
    first = client.responses.create(model=model, input=ASK, tools=[TOOL], temperature=0,
                                    max_output_tokens=100)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}
    follow = client.responses.create(model=model, previous_response_id=first.id, input=[result],
                                     tools=[TOOL], temperature=0, max_output_tokens=20)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens
    # The same conversation sent whole renders the same prompt.
    whole = client.responses.create(model=model, tools=[TOOL], temperature=0, max_output_tokens=20,
                                    input=[{"role": "user", "content": ASK},
                                           *[o.model_dump() for o in first.output], result])
    assert whole.usage.input_tokens == follow.usage.input_tokens
    assert whole.output_text == follow.output_text

    # Streamed: the call is an item with its argument deltas.
    events = list(client.responses.create(model=model, input=ASK, tools=[TOOL], temperature=0,
                                          max_output_tokens=100, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added][-1] == "function_call"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris", "days": 3}
    assert events[-1].type == "response.completed"

    # The SDK's own accumulator agrees (it needs response.completed).
    with client.responses.stream(model=model, input=ASK, tools=[TOOL], temperature=0,
                                 max_output_tokens=100) as stream:
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        ("function_call", "get_weather", calls[0].arguments)]
    assert final.output_text == first.output_text


def test_forced_call_and_json_format(client):
    forced = client.responses.create(model="hermes", input=ASK, tools=[TOOL], temperature=0,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     parallel_tool_calls=False, max_output_tokens=100)
    assert [o.type for o in forced.output] == ["function_call"]
    assert isinstance(json.loads(forced.output[0].arguments)["city"], str)

    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "score": {"type": "integer", "maximum": 100}},
              "required": ["answer", "score"], "additionalProperties": False}  # fmt: skip
    for i in range(4):
        r = client.responses.create(model="demo", input="Rate this code: print(1)", temperature=0.7,
                                    max_output_tokens=80, extra_body={"seed": i},
                                    text={"format": {"type": "json_schema", "name": "rating",
                                                     "schema": schema, "strict": True}})
        assert r.status == "completed"
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(r.output_text))


def test_previous_responses_are_per_key_and_bounded_by_store(client):
    kept = client.responses.create(model="demo", input="hi", max_output_tokens=2)
    unkept = client.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    follow = client.responses.create(model="demo", input="and?", max_output_tokens=2,
                                     previous_response_id=kept.id)
    assert follow.usage.input_tokens > kept.usage.input_tokens
    for gone in (unkept.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="demo", input="x", max_output_tokens=2,
                                    previous_response_id=gone)
        assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "warp_drive"}]}, "tools"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"background": True}, "background"),
])  # fmt: skip
def test_bad_requests_are_openai_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**({"model": "demo", "input": "x", "max_output_tokens": 2} | body))
    assert e.value.body["type"] == "invalid_request_error"
    # A field's own error names it as param; a rule over the body, in its message.
    named = (e.value.body["param"] or "").startswith(param)
    assert named or f"{param}: " in e.value.body["message"], e.value.body
    assert client.responses.create(model="demo", input="x", max_output_tokens=2).status
