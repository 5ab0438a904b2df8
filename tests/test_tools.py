"""Tool calls: parsing (mlx-lm's parsers) in streamed text, and end to end through both SDKs.

The end-to-end half serves two hand-built checkpoints (tests/tool_caller.py)
whose greedy answer is a known tool call, one per format, each with its own
chat template in that format; the gateway picks the parser from the template.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from conftest import start_gateway, stop_gateway
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_caller import HERMES_TEMPLATE, XML_TEMPLATE, build_tool_caller

from specgate.gateway.api.tools import (
    ToolCall,
    ToolCallStream,
    parse_call,
    split_output,
    tool_format,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = ToolCall("get_weather", {"city": "Paris", "days": 3})
HERMES_ANSWER = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
XML_ANSWER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)

# -- parsing ----------------------------------------------------------------------


def test_format_is_read_from_the_template():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format(XML_TEMPLATE) == "qwen3_xml"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None
    # Other formats, as mlx-lm recognises them, parsed by its parsers.
    assert tool_format("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert tool_format("{% if tools %}<arg_key>{% endif %}") == "glm47"
    assert tool_format("{% if tools %}<call>{% endif %}") is None  # in no format we know


def test_formats_mlx_lm_parses():
    text = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
    assert split_output(text, "mistral") == ("Checking.", [CALL])
    assert split_output(text[:-3], "mistral") == (text[:-3], [])  # cut short: text


def test_hermes_calls():
    assert split_output(HERMES_ANSWER, "hermes") == ("Let me look that up.", [CALL])
    two = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>'
    )
    assert split_output(two, "hermes") == ("", [ToolCall("a", {}), ToolCall("b", {"x": [1, 2]})])
    assert parse_call('{"name": "f"}', "hermes") == [ToolCall("f", {})]
    assert parse_call('{"name": "f", "parameters": {"a": 1}}', "hermes") == [ToolCall("f", {"a": 1})]


def test_xml_calls_typed_by_schema():
    assert split_output(XML_ANSWER, "qwen3_xml", TOOLS) == ("", [CALL])
    # Without a schema every value is text; multi-line values keep their lines.
    body = "\n<function=write>\n<parameter=text>\nline 1\nline 2\n</parameter>\n</function>\n"
    assert parse_call(body, "qwen3_xml") == [ToolCall("write", {"text": "line 1\nline 2"})]
    types = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "number"}, "ok": {"type": "boolean"}, "xs": {"type": "array"},
        "o": {"type": "object"}}}}}]  # fmt: skip
    body = (
        "<function=f>\n<parameter=n>\n2.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
        '<parameter=xs>\n[1, "a"]\n</parameter>\n<parameter=o>\n{"k": null}\n</parameter>\n'
        "</function>"
    )
    assert parse_call(body, "qwen3_xml", types) == [ToolCall(
        "f", {"n": 2.5, "ok": True, "xs": [1, "a"], "o": {"k": None}}
    )]


MALFORMED = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>'),
    ("hermes", '<tool_call>\n["not", "an", "object"]\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", 'text <tool_call>\n{"name": "f", "arguments": {}}'),  # never closed
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\n1\n"),  # cut off
]


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_come_back_as_text(fmt, text):
    assert split_output(text, fmt) == (text, [])


def test_text_without_calls_is_untouched():
    for text in ["", "plain", "a < b and tool_call", "  spaces  \n", "<tool_", "x <tool_call"]:
        assert split_output(text, "hermes") == (text, []), text


def _streamed(text: str, cuts: list[int], fmt, tools=None):
    stream = ToolCallStream(fmt, tools or [])
    events, last = [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += stream.feed(text[last:cut])
        last = cut
    events += stream.finish()
    return "".join(e for e in events if isinstance(e, str)), [
        e for e in events if isinstance(e, ToolCall)
    ]


SAMPLES = [
    ("hermes", HERMES_ANSWER + "\nDone."),
    ("hermes", HERMES_ANSWER + "\n" + HERMES_ANSWER),
    ("qwen3_xml", "I'll check.\n\n" + XML_ANSWER + "\n" + XML_ANSWER),
    ("mistral", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    *MALFORMED,
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_streaming_split_anywhere_equals_whole(sample, data):
    fmt, text = sample
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert _streamed(text, cuts, fmt, TOOLS) == split_output(text, fmt, TOOLS)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="<>/\n tolcaq_{}\"':=", max_size=60), st.data())
def test_any_text_survives_streaming(text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got_text, calls = _streamed(text, cuts, "hermes")
    assert (got_text, calls) == split_output(text, "hermes")
    if not calls:
        assert got_text == text  # nothing parsed, nothing lost


def test_text_before_a_call_streams_before_it_completes():
    stream = ToolCallStream("hermes")
    assert stream.feed("Let me look that up.") == ["Let me look that up."]
    assert stream.feed("\n<tool_call>\n{") == []
    assert stream.feed('"name": "f", "arguments": {}}\n</tool_call>') == [ToolCall("f", {})]
    assert stream.finish() == []


# -- end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-models")
    hermes = build_tool_caller(root / "hermes", HERMES_TEMPLATE, HERMES_ANSWER)
    xml = build_tool_caller(root / "xml", XML_TEMPLATE, XML_ANSWER)
    gw = start_gateway(
        {
            "models": [
                {"id": "hermes", "path": str(hermes), "max_context": 2048},
                {"id": "xml", "path": str(xml), "max_context": 2048},
            ]
        },
        tmp_path_factory.mktemp("tool-gateway"),
    )
    yield gw
    stop_gateway(gw)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORMATS = {"hermes": "Let me look that up.", "xml": None}  # model -> text before the call


@pytest.mark.parametrize("model", list(FORMATS))
def test_openai_tool_calls(tool_gateway, model):
    client = openai.OpenAI(base_url=tool_gateway.api, api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=100
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == FORMATS[model]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=100, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert text == (FORMATS[model] or "")
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # tool_choice "none": the same output, as text.
    plain = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=100
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == (HERMES_ANSWER if model == "hermes" else XML_ANSWER)

    # The follow-up carrying the result renders through the template, tools and all.
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    again = client.chat.completions.create(
        model=model, messages=follow, tools=TOOLS, temperature=0, max_tokens=100
    )
    assert again.usage.prompt_tokens > resp.usage.prompt_tokens


def _local_prompt_tokens(path, messages, tools) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return len(
        tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_dict=False
        )
    )


@pytest.mark.parametrize("model", list(FORMATS))
def test_anthropic_tool_use(tool_gateway, model):
    client = anthropic.Anthropic(base_url=tool_gateway.base_url, api_key="unused", max_retries=0)
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]  # fmt: skip
    kw = dict(model=model, max_tokens=100, messages=ASK, tools=tools,
              extra_body={"temperature": 0})  # fmt: skip
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    blocks = msg.content
    if FORMATS[model]:
        assert blocks[0].type == "text" and blocks[0].text == FORMATS[model]
        blocks = blocks[1:]
    (use,) = blocks
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}

    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in msg.content]
    assert final.content[-1].input == {"city": "Paris", "days": 3}
    assert final.stop_reason == "tool_use"
    events = [e.type for e in client.messages.create(**kw, stream=True)]
    assert events[0] == "message_start" and events[-1] == "message_stop"

    # The follow-up with a tool_result renders through the template: its
    # length is the local rendering's of the equivalent OpenAI-shaped chat.
    follow = [
        *ASK,
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ]  # fmt: skip
    counted = client.messages.count_tokens(model=model, messages=follow, tools=tools)
    again = client.messages.create(**kw | {"messages": follow})
    prompt = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)  # noqa: E731
    assert prompt(again.usage) == counted.input_tokens > prompt(msg.usage)
    path = next(m["path"] for m in _served(tool_gateway) if m["id"] == model)
    local = [
        *ASK,
        {"role": "assistant", "content": FORMATS[model] or "", "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    assert counted.input_tokens == _local_prompt_tokens(path, local, TOOLS)


def _served(gw) -> list[dict]:
    import yaml

    cfg = gw.log_path.parent / "specgate.yaml"
    return yaml.safe_load(cfg.read_text())["models"]


def _valid_weather_args(arguments: dict) -> bool:
    return (set(arguments) <= {"city", "days"} and isinstance(arguments.get("city"), str)
            and isinstance(arguments.get("days", 0), int))  # fmt: skip


@pytest.mark.parametrize("model", list(FORMATS))
def test_forced_tool_calls(tool_gateway, model):
    """tool_choice "required" / a named function (OpenAI), "any" / "tool"
    (Anthropic): the output is calls in the model's format, arguments of the
    tool's schema, and no text, though this model answers with text first
    (hermes) when free to."""
    client = openai.OpenAI(base_url=tool_gateway.api, api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, stream in (("required", False), (named, True)):
        kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                  max_tokens=100, parallel_tool_calls=False)
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
            calls = [t.function for c in chunks for t in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice_ = client.chat.completions.create(**kw).choices[0]
            assert not choice_.message.content
            calls, finish = [t.function for t in choice_.message.tool_calls], choice_.finish_reason
        assert finish == "tool_calls" and [c.name for c in calls] == ["get_weather"]
        assert _valid_weather_args(json.loads(calls[0].arguments))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice" and "nope" in err.value.body["message"]

    claude = anthropic.Anthropic(base_url=tool_gateway.base_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = claude.messages.create(model=model, messages=ASK, tools=tools, tool_choice=choice,
                                     max_tokens=100, extra_body={"temperature": 0})
        assert msg.stop_reason == "tool_use"
        assert [b.type for b in msg.content] == ["tool_use"]
        assert msg.content[0].name == "get_weather" and _valid_weather_args(msg.content[0].input)
