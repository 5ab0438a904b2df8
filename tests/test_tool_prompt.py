"""Tools on a chat template without tool support, through specgate's
tool-use prompt (gateway/api/tools.py, its end), as a model opts in with
`tool_prompt: default`.

The tiny checkpoint's template is plain ChatML with no tools
(builders/tokenizer.CHAT_TEMPLATE) and its weights are random: a call
comes out only where the grammar forces one (tool_choice required or
named), and the grammar alone makes its arguments follow the schema.
Those are checked here against the schema by hand (no JSON Schema
library in the venv), through the real SDKs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import llguidance
import llguidance.hf
import openai
import pytest
from conftest import start_gateway, stop_gateway
from mlx_lm.tokenizer_utils import load
from tool_caller import build_tool_caller

from specgate.builders.gguf_export import export_gguf
from specgate.builders.tokenizer import CHAT_TEMPLATE, write_chat_template
from specgate.gateway.api.structured import _text_then_calls
from specgate.gateway.api.tools import (
    PROMPT_TOOL_FORMAT,
    split_output,
    tool_use_prompt,
    tools_as_text,
)
from specgate.gateway.config import parse_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
        "required": ["zone"], "additionalProperties": False}},
}  # fmt: skip
TOOLS = [WEATHER, CLOCK]


def valid_arguments(name: str, args: dict, lengths: bool = True) -> bool:
    """The arguments follow the tool's schema (its keywords used above).
    `lengths`: check maxLength too (not under llama-server, whose grammar
    lets byte-fragment tokens through that decode to more characters)."""
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    props = schema["properties"]
    if not set(schema["required"]) <= set(args) or not set(args) <= set(props):
        return False
    for key, value in args.items():
        sub = props[key]
        if sub["type"] == "string" and not (isinstance(value, str)
                                            and (not lengths or len(value) <= sub.get("maxLength", 1 << 30))):
            return False
        if "enum" in sub and value not in sub["enum"]:
            return False
        if sub["type"] == "integer" and not (isinstance(value, int) and not isinstance(value, bool)
                                             and sub["minimum"] <= value <= sub["maximum"]):
            return False
    return True


# -- the prompt and the history as text ---------------------------------------------


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]  # fmt: skip
CALLS_TEXT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
)
RESULTS_TEXT = (
    "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>\n"
    "Thanks. And tomorrow?"
)


def test_history_as_text():
    rendered = tools_as_text(HISTORY, TOOLS)
    prompt = tool_use_prompt(TOOLS)
    assert rendered == [
        {"role": "system", "content": "Be brief.\n\n" + prompt},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": CALLS_TEXT},
        {"role": "user", "content": RESULTS_TEXT},
    ]
    # Each tool's schema is in the prompt, one JSON line each.
    assert json.dumps(WEATHER) in prompt.splitlines() and json.dumps(CLOCK) in prompt.splitlines()
    # An earlier call reads as the model writes one: it parses back.
    text, calls = split_output(CALLS_TEXT, PROMPT_TOOL_FORMAT, TOOLS)
    assert text == "Checking." and [c.name for c in calls] == ["get_weather", "get_time"]
    # No system turn: the prompt opens the first user message; no tools: no prompt.
    no_system = tools_as_text(HISTORY[1:], TOOLS, system_turn=False)
    assert no_system[0] == {"role": "user", "content": prompt + "\n\nWeather in Paris and the time?"}
    assert tools_as_text(HISTORY, [])[0] == HISTORY[0]


def test_anthropic_results_with_text_share_one_user_turn():
    # Anthropic's adapter gives a user turn's tool_result blocks as tool
    # messages, then the turn's text: one user turn here.
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "noon"},
            {"role": "user", "content": "ok"}]  # fmt: skip
    out = tools_as_text(msgs, [])
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert out[2]["content"] == "<tool_response>\nnoon\n</tool_response>\nok"


# -- the grammar: text, or text then calls of the tools' schemas ----------------------

DEMO = Path(__file__).parents[1] / "specgate" / "engines" / "checkpoints" / "demo"


@pytest.fixture(scope="module")
def tokenizer():
    tw = load(DEMO)
    ll = llguidance.hf.from_tokenizer(tw._tokenizer, n_vocab=4096, eos_token=sorted(tw.eos_token_ids))
    return tw, ll


def accepts(tokenizer, grammar: str, text: str) -> bool:
    tw, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, grammar)
    tokens = tw.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting()
    )


def test_text_then_calls_grammar(tokenizer):
    grammar = _text_then_calls(TOOLS, parallel=True).grammar
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    assert accepts(tokenizer, grammar, "")
    assert accepts(tokenizer, grammar, "Just text, with <tool and </tool_call> in it.\n")
    assert accepts(tokenizer, grammar, "Let me check.\n" + CALLS_TEXT[len("Checking.\n") :])
    assert accepts(tokenizer, grammar, call)
    assert not accepts(tokenizer, grammar, call + "\nmore text after the calls")
    # The tag in text is a call's start to the parser: only where a call opens.
    assert not accepts(tokenizer, grammar, "say <tool_call> once. " + call)
    assert accepts(tokenizer, grammar, "almost <tool_call, then " + call)
    assert not accepts(tokenizer, grammar, call.replace('"utc"', '"mars"'))  # not in the enum
    assert not accepts(tokenizer, grammar, call.replace("get_time", "get_date"))  # no such tool
    missing = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert not accepts(tokenizer, grammar, missing)  # `unit` is required
    single = _text_then_calls(TOOLS, parallel=False).grammar
    assert accepts(tokenizer, single, "x " + call)
    assert not accepts(tokenizer, single, call + "\n" + call)


def test_the_config_key():
    model = {"id": "m", "path": str(DEMO)}
    assert parse_config({"models": [model]}).models[0].tool_prompt is None
    assert parse_config({"models": [model | {"tool_prompt": "default"}]}).models[0].tool_prompt
    with pytest.raises(Exception, match="tool_prompt"):
        parse_config({"models": [model | {"tool_prompt": "lmstudio"}]})


# -- end to end ----------------------------------------------------------------------


# Answers of two hand-built checkpoints (tests/tool_caller.py) on the same
# plain ChatML template: a call that follows the schema, and one that does
# not (`days` a string, `unit` missing), as a small model may write one.
GOOD_CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "c", "days": 2}}\n</tool_call>')  # fmt: skip
SLOPPY_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": "two"}}\n</tool_call>')  # fmt: skip


# ChatML that renders no system turn: one drops it, one refuses it (as
# Gemma 2's and early Mistral templates raise on it).
DROPS_SYSTEM = CHAT_TEMPLATE.replace("{%- for message in messages -%}",
                                     "{%- for message in messages if message['role'] != 'system' -%}")
REFUSES_SYSTEM = ("{%- for message in messages if message['role'] == 'system' -%}"
                  "{{- raise_exception('System role not supported') -}}{%- endfor -%}" + CHAT_TEMPLATE)


# A reasoning model without tools: ChatML whose generation prompt opens
# `<think>`; its thought names the call tag, which only the answer may use.
THINKING_CHATML = CHAT_TEMPLATE.replace("'<|im_start|>assistant\\n'",
                                        "'<|im_start|>assistant\\n<think>\\n'")
THOUGHT = "Call <tool_call> for it? Yes."


@pytest.fixture(scope="module")
def prompt_gateway(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-prompt-models")
    good = build_tool_caller(root / "good", CHAT_TEMPLATE, GOOD_CALL)
    thinker = build_tool_caller(root / "thinker", THINKING_CHATML,
                                f"{THOUGHT}\n</think>\n\n{GOOD_CALL}", thinking=True,
                                tail="<|im_end|>\n<|im_start|>assistant\n<think>\n")  # fmt: skip
    sloppy = build_tool_caller(root / "sloppy", CHAT_TEMPLATE, SLOPPY_CALL)
    no_system = {}
    for name, template in (("drops", DROPS_SYSTEM), ("refuses", REFUSES_SYSTEM)):
        no_system[name] = shutil.copytree(tiny_model, root / name)
        write_chat_template(no_system[name], template)
    gw = start_gateway({"models": [
        {"id": "prompted", "path": str(tiny_model), "max_context": 2048, "tool_prompt": "default"},
        {"id": "plain", "path": str(tiny_model), "max_context": 2048},
        {"id": "good", "path": str(good), "max_context": 2048, "tool_prompt": "default"},
        {"id": "sloppy", "path": str(sloppy), "max_context": 2048, "tool_prompt": "default"},
        {"id": "thinker", "path": str(thinker), "max_context": 2048, "tool_prompt": "default"},
    ] + [{"id": name, "path": str(path), "max_context": 2048, "tool_prompt": "default"}
         for name, path in no_system.items()]}, tmp_path_factory.mktemp("tool-prompt"))  # fmt: skip
    yield gw
    stop_gateway(gw)


def test_a_call_left_to_the_model_comes_back_as_a_call(prompt_gateway):
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="good", messages=ASK, tools=TOOLS, max_tokens=64,
                                       temperature=0)  # fmt: skip
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c", "days": 2}
    claude = anthropic.Anthropic(base_url=prompt_gateway.base_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    m = claude.messages.create(model="good", max_tokens=64, messages=ASK, tools=tools)
    assert m.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in m.content] == [
        ("text", "Let me check."), ("tool_use", {"city": "Paris", "unit": "c", "days": 2})]
    ollama = httpx.post(prompt_gateway.base_url + "/api/chat", timeout=60, json={
        "model": "good", "messages": ASK, "tools": TOOLS, "stream": False,
        "options": {"temperature": 0}}).json()  # fmt: skip
    assert [c["function"] for c in ollama["message"]["tool_calls"]] == [
        {"index": 0, "name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 2}}]
    resp_tools = [{"type": "function", "name": t["function"]["name"],
                   "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]  # fmt: skip
    r = client.responses.create(model="good", input=ASK[0]["content"], tools=resp_tools,
                                max_output_tokens=64, temperature=0)  # fmt: skip
    assert [(i.type, getattr(i, "name", None)) for i in r.output] == [
        ("message", None), ("function_call", "get_weather")]
    assert json.loads(r.output[1].arguments) == {"city": "Paris", "unit": "c", "days": 2}


def test_the_grammar_holds_a_call_the_model_gets_wrong(prompt_gateway):
    """Left to itself the model writes a call that breaks the schema; under
    the grammar the call it starts follows the schema, so it parses."""
    (sloppy,) = split_output(SLOPPY_CALL, "hermes", TOOLS)[1]
    assert not valid_arguments(sloppy.name, sloppy.arguments)
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    for stream in (False, True):
        r = client.chat.completions.create(model="sloppy", messages=ASK, tools=TOOLS,
                                           max_tokens=96, temperature=0, stream=stream)  # fmt: skip
        if stream:
            parts = {}
            for chunk in r:
                for c in chunk.choices[0].delta.tool_calls or []:
                    parts.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments
            calls = [(n, json.loads(a)) for n, a in parts.values()]
        else:
            calls = [(c.function.name, json.loads(c.function.arguments))
                     for c in r.choices[0].message.tool_calls or []]  # fmt: skip
        assert len(calls) == 1 and calls[0][0] == "get_weather", calls
        assert valid_arguments(*calls[0]) and calls[0][1]["city"] == "Paris", calls
    # tool_choice "none": no grammar, nothing parsed: the model's own text.
    r = client.chat.completions.create(model="sloppy", messages=ASK, tools=TOOLS, max_tokens=96,
                                       temperature=0, tool_choice="none")  # fmt: skip
    assert r.choices[0].message.content == SLOPPY_CALL and not r.choices[0].message.tool_calls


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_forced_call(prompt_gateway, choice):
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    for seed in range(3):
        r = client.chat.completions.create(model="prompted", messages=ASK, tools=TOOLS,
                                           tool_choice=choice, max_tokens=96, seed=seed,
                                           temperature=1.0, parallel_tool_calls=False)  # fmt: skip
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0
        for call in choice0.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert valid_arguments(call.function.name, args), (call.function.name, args)
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"


def test_openai_forced_call_streamed(prompt_gateway):
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="prompted", messages=ASK, tools=TOOLS, stream=True, max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0,
        parallel_tool_calls=False)
    calls, finish = {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for c in delta.tool_calls or []:
            calls.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    assert all(n == "get_time" and valid_arguments(n, json.loads(a)) for n, a in calls.values())


def test_openai_auto_runs_under_the_grammar(prompt_gateway):
    # Left to the model: text, or calls that parse; random weights rarely
    # call, so this shows the grammar compiles and the engine runs it.
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="prompted", messages=ASK, tools=TOOLS, max_tokens=24,
                                       temperature=0)  # fmt: skip
    msg = r.choices[0].message
    assert "<tool_call>" not in (msg.content or "")
    for call in msg.tool_calls or []:
        assert valid_arguments(call.function.name, json.loads(call.function.arguments))


def test_without_the_opt_in_tools_are_a_400(prompt_gateway):
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, max_tokens=4)
    assert e.value.code == "tools_unsupported" and "does not support tools" in str(e.value)
    claude = anthropic.Anthropic(base_url=prompt_gateway.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="does not support tools"):
        claude.messages.create(model="plain", max_tokens=4, messages=ASK,
                               tools=[{"name": "get_time", "input_schema": CLOCK["function"]["parameters"]}])


def test_anthropic_forced_call(prompt_gateway):
    claude = anthropic.Anthropic(base_url=prompt_gateway.base_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    # One call each: random weights, free to call again, seldom stop calling.
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        msg = claude.messages.create(model="prompted", max_tokens=96, messages=ASK, tools=tools,
                                     tool_choice=choice)  # fmt: skip
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses, msg
        for use in uses:
            assert valid_arguments(use.name, use.input), (use.name, use.input)
            assert choice["type"] == "any" or use.name == "get_weather"


def test_responses_forced_call(prompt_gateway):
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]  # fmt: skip
    r = client.responses.create(model="prompted", input="What time is it?", tools=tools,
                                tool_choice="required", max_output_tokens=96,
                                parallel_tool_calls=False)  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(valid_arguments(c.name, json.loads(c.arguments)) for c in calls)


def test_ollama_lists_tools_and_takes_them(prompt_gateway):
    show = {m: httpx.post(prompt_gateway.base_url + "/api/show", json={"model": m}).json()
            for m in ("prompted", "plain")}  # fmt: skip
    assert "tools" in show["prompted"]["capabilities"]
    assert "tools" not in show["plain"]["capabilities"]
    # Ollama has no tool_choice: left to the model, with the grammar.
    r = httpx.post(prompt_gateway.base_url + "/api/chat", timeout=60, json={
        "model": "prompted", "messages": ASK, "tools": TOOLS, "stream": False,
        "options": {"num_predict": 16, "temperature": 0}})  # fmt: skip
    assert r.status_code == 200, r.text
    for call in r.json()["message"].get("tool_calls") or []:
        assert valid_arguments(call["function"]["name"], call["function"]["arguments"])


def _chatml(messages: list[dict]) -> str:
    """The tiny checkpoint's template (builders/tokenizer.CHAT_TEMPLATE), by hand."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                   for m in messages) + "<|im_start|>assistant\n"  # fmt: skip


def _prompt_tokens_and_greedy(gw, prompt: str) -> tuple[int, list[int]]:
    r = httpx.post(gw.api + "/completions", timeout=60, json={
        "model": "prompted", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"], r.json()["choices"][0]["token_ids"]


def _relative(lps: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Logprobs less the top one's, by token text; as a dict, as
    /v1/completions gives them (byte tokens that each decode to U+FFFD
    share one entry there: the last)."""
    top = max(lp for _, lp in lps)
    return sorted((t, round(lp - top, 3)) for t, lp in dict(lps).items())


def _first_logprobs(gw, prompt: str, model: str = "prompted") -> list[tuple[str, float]]:
    r = httpx.post(gw.api + "/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "logprobs": 5})  # fmt: skip
    return _relative(list(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].items()))


def test_history_renders_as_text_through_every_api(prompt_gateway):
    """The prompt specgate builds for a tool history equals the text written
    out by hand above (rendered by ChatML): same prompt token count as that
    text on /v1/completions, and, with tool_choice "none" (no grammar, no
    tool list), the same greedy tokens."""
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": CALLS_TEXT},
        {"role": "user", "content": RESULTS_TEXT},
    ]
    openai_history = [m if "tool_calls" not in m else m | {"tool_calls": [
        c | {"function": c["function"] | {"arguments": json.dumps(c["function"]["arguments"])
                                          if isinstance(c["function"]["arguments"], dict)
                                          else c["function"]["arguments"]}}
        for c in m["tool_calls"]]} for m in HISTORY]  # fmt: skip
    count, greedy = _prompt_tokens_and_greedy(prompt_gateway, _chatml(expected))
    r = client.chat.completions.create(model="prompted", messages=openai_history, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert r.usage.prompt_tokens == count
    assert r.choices[0].model_extra["token_ids"] == greedy
    # With the tools offered, the prompt lists them in the system message.
    listed = [expected[0] | {"content": "Be brief.\n\n" + tool_use_prompt(TOOLS)}]
    listed_count, listed_greedy = _prompt_tokens_and_greedy(prompt_gateway,
                                                            _chatml(listed + expected[1:]))
    # Held to text or calls, where text is anything but a call's tag, but
    # valid UTF-8: the grammar masks some tokens, so the first token's
    # logprobs are compared relative to the top one's (a mask renormalises).
    r = client.chat.completions.create(model="prompted", messages=openai_history, tools=TOOLS,
                                       max_tokens=1, temperature=0, logprobs=True,
                                       top_logprobs=5)  # fmt: skip
    assert r.usage.prompt_tokens == listed_count
    chat_lps = [(t.token, t.logprob) for t in r.choices[0].logprobs.content[0].top_logprobs]
    assert _relative(chat_lps) == _first_logprobs(prompt_gateway, _chatml(listed + expected[1:]))
    # ... which tell apart the same text with the tool-use prompt in the user's message.
    in_user = [expected[0], expected[1] | {
        "content": tool_use_prompt(TOOLS) + "\n\n" + expected[1]["content"]}]
    assert _relative(chat_lps) != _first_logprobs(prompt_gateway, _chatml(in_user + expected[2:]))
    # Anthropic's tool_use / tool_result blocks: the same prompt.
    claude = anthropic.Anthropic(base_url=prompt_gateway.base_url, api_key="unused", max_retries=0)
    anthropic_history = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "c1", "name": "get_weather",
             "input": {"city": "Paris", "unit": "c"}},
            {"type": "tool_use", "id": "c2", "name": "get_time", "input": {"zone": "utc"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": "18 C, sunny"},
            {"type": "tool_result", "tool_use_id": "c2", "content": "12:00"},
            {"type": "text", "text": "Thanks. And tomorrow?"}]},
    ]  # fmt: skip
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    count_none = claude.messages.count_tokens(model="prompted", system="Be brief.",
                                              messages=anthropic_history, tools=tools,
                                              tool_choice={"type": "none"})  # fmt: skip
    assert count_none.input_tokens == count
    # Responses: function_call and function_call_output items.
    items = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "c"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "utc"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C, sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "12:00"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]  # fmt: skip
    resp_tools = [{"type": "function", "name": t["function"]["name"],
                   "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]  # fmt: skip
    r = client.responses.create(model="prompted", instructions="Be brief.", input=items,
                                tools=resp_tools, tool_choice="none", max_output_tokens=8,
                                temperature=0)  # fmt: skip
    assert r.usage.input_tokens == count
    # Ollama: tool_calls with arguments as an object, tool messages.
    ollama_history = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in openai_history]
    for m in ollama_history:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    r = httpx.post(prompt_gateway.base_url + "/api/chat", timeout=60, json={
        "model": "prompted", "messages": ollama_history, "stream": False,
        "options": {"num_predict": 1}}).json()  # fmt: skip
    assert r["prompt_eval_count"] == count


# -- llama.cpp: a grammar there is one JSON schema, at temperature 0 -------------------


@pytest.fixture(scope="module")
def llamacpp_gateway(tiny_model, llama_server_binary, tmp_path_factory):
    """The tiny checkpoint as a GGUF (its plain ChatML template in the
    metadata) under llama-server, with the opt-in."""
    gguf = export_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny.gguf", include_mtp=False)
    gw = start_gateway({"llama_server": {"binary": str(llama_server_binary)}, "models": [
        {"id": "prompted-gguf", "path": str(gguf), "engines": ["llamacpp"], "max_concurrent": 1,
         "max_context": 1024, "llamacpp": {"threads": 1}, "tool_prompt": "default"},
    ]}, tmp_path_factory.mktemp("tool-prompt-llamacpp"))  # fmt: skip
    yield gw
    stop_gateway(gw)


@pytest.mark.timeout(600)
def test_llamacpp_forced_call_at_temperature_0(llamacpp_gateway):
    """A forced single call is one JSON schema between the call tags, which
    llama-server takes at temperature 0; tools left to the model get no
    grammar there (a Lark grammar it cannot take), so it answers freely;
    a grammar above temperature 0 is refused, as for any forced call."""
    client = openai.OpenAI(base_url=llamacpp_gateway.api, api_key="unused", max_retries=0)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model="prompted-gguf", messages=ASK, tools=TOOLS,
                                           tool_choice=choice, parallel_tool_calls=False,
                                           max_tokens=96, temperature=0)  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert valid_arguments(call.function.name, args, lengths=False), args
    r = client.chat.completions.create(model="prompted-gguf", messages=ASK, tools=TOOLS,
                                       max_tokens=8, temperature=0.7)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="temperature 0"):
        client.chat.completions.create(model="prompted-gguf", messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=8, temperature=0.7)  # fmt: skip


@pytest.mark.parametrize("model", ["drops", "refuses"])
def test_a_template_without_a_system_turn_gets_the_prompt_in_the_user_message(
        prompt_gateway, model):  # fmt: skip
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1,
                                       temperature=0, logprobs=True, top_logprobs=5)  # fmt: skip
    in_user = [{"role": "user", "content": tool_use_prompt(TOOLS) + "\n\n" + ASK[0]["content"]}]
    count = httpx.post(prompt_gateway.api + "/completions", json={
        "model": model, "prompt": _chatml(in_user), "max_tokens": 1}).json()["usage"]  # fmt: skip
    assert r.usage.prompt_tokens == count["prompt_tokens"]
    chat_lps = [(t.token, t.logprob) for t in r.choices[0].logprobs.content[0].top_logprobs]
    assert _relative(chat_lps) == _first_logprobs(prompt_gateway, _chatml(in_user), model)


def test_a_thought_is_not_held_to_calls(prompt_gateway):
    """The grammar starts after the thinking: a thought may say the call tag."""
    assert "tools" not in THINKING_CHATML and "<think>" in THINKING_CHATML
    client = openai.OpenAI(base_url=prompt_gateway.api, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="thinker", messages=ASK, tools=TOOLS, max_tokens=96,
                                       temperature=0)  # fmt: skip
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == THOUGHT
    assert msg.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c", "days": 2}
