"""What real coding agents send for a tool turn, replayed through their own SDKs.

tests/fixtures/agents/AGENT-VERSION/ holds each request a pinned agent made
for one tool turn (captured from the real client; README.md there says
how). Each is sent as it came, through the SDK of its API (anthropic for
Claude Code's /v1/messages, openai for OpenCode's and Qwen Code's chat
completions), its headers included, to a real gateway: accepted, and
every streamed event parses in the SDK's types. The first request with
tools is sent again with the tool the agent called forced: specgate's call
comes back as the SDK's own tool-call type, its arguments those of the
tool's schema.

The model is swapped for "agent", a tiny Qwen3.5 hybrid with the demo's
tool template and a context the agents' prompts (10k-25k tokens) fit, so
a replay costs seconds where the demo's prefill would take minutes; its
output is noise, so max_tokens is lowered. The same gateway shows what
these requests needed of specgate: a system message mid-conversation (Claude
Code's environment) taken, and given as a user message to a template that
refuses late system messages, as Qwen3.5's own does; and the demo's replies
ending at its reply stop, as a natural end.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import anthropic
import openai
import pytest
from conftest import start_gateway, stop_gateway

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.builders.tokenizer import CHAT_TEMPLATE, DEMO_CHAT_TEMPLATE, write_chat_template

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
REPLY_TOKENS = 8  # the tiny model's output is noise: a few tokens show the reply's shape
# Qwen3.5's own template refuses a system message after the first; this one does too.
STRICT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}"
    "{%- endif -%}{%- endfor -%}" + CHAT_TEMPLATE
)


# The folders capture_chat.py wrote (each entry: method, path, headers,
# body); Codex's, Continue's and aider's have their own replays
# (test_codex_responses.py, test_agent_fixtures_more.py).
AGENTS = ("claude-2.1.332", "opencode-1.18.33", "qwen-0.24.4")


def _fixtures() -> list[Path]:
    return sorted(p for agent in AGENTS for p in (FIXTURES / agent).glob("*.json"))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-fixtures")
    # Two layers, one of each kind: most of a replay's seconds are the prefill
    # of 10-25k tokens, a GatedDeltaNet layer's a token at a time on a CPU.
    agent = build_qwen35_hybrid(
        root / "agent", seed=3, max_position_embeddings=65536, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, full_attention_interval=2,
    )
    write_chat_template(agent, DEMO_CHAT_TEMPLATE)
    strict = build_qwen35_hybrid(root / "strict", seed=3)
    write_chat_template(strict, STRICT_TEMPLATE)
    g = start_gateway({"models": [
        {"id": "agent", "path": str(agent), "max_context": 65536, "engines": ["mlx_plain"]},
        {"id": "strict", "path": str(strict), "max_context": 2048, "engines": ["mlx_plain"]},
        {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain"], "reply_stop": ["\n\n"]},
    ]}, root)  # fmt: skip
    yield g
    stop_gateway(g)


def _split(create, body: dict) -> tuple[dict, dict]:
    """The body as an SDK call's keyword arguments, and extra_body for what
    the SDK version here does not name."""
    known = set(inspect.signature(create).parameters) - {"extra_body", "extra_headers"}
    return ({k: v for k, v in body.items() if k in known},
            {k: v for k, v in body.items() if k not in known})  # fmt: skip


def _anthropic_call(client: anthropic.Anthropic, entry: dict, body: dict):
    """messages.create as the agent made it: the beta surface for ?beta=true,
    its anthropic-beta header as `betas`."""
    beta = "beta=true" in entry["path"]
    messages = client.beta.messages if beta else client.messages
    kwargs, extra = _split(messages.create, body)
    if beta and "anthropic-beta" in entry["headers"]:
        kwargs["betas"] = entry["headers"]["anthropic-beta"].split(",")
    return messages.create(**kwargs, extra_body=extra or None)


def _openai_call(client: openai.OpenAI, body: dict):
    kwargs, extra = _split(client.chat.completions.create, body)
    return client.chat.completions.create(**kwargs, extra_body=extra or None)


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_request_is_accepted_and_answered_in_the_sdk_types(gw, path):
    entry = _load(path)
    body = entry["body"] | {"model": "agent"}
    for limit in ("max_tokens", "max_completion_tokens"):
        if limit in body:
            body[limit] = REPLY_TOKENS
    if entry["path"].startswith("/v1/messages"):
        client = anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0)
        reply = _anthropic_call(client, entry, body)
        if body.get("stream"):
            events = list(reply)
            assert all(isinstance(e, anthropic.BaseModel) for e in events)
            assert events[0].type == "message_start" and events[-1].type == "message_stop"
            stop = next(e for e in events if e.type == "message_delta").delta.stop_reason
        else:
            stop = reply.stop_reason
        assert stop in ("end_turn", "max_tokens", "tool_use")
    else:
        client = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
        reply = _openai_call(client, body)
        if body.get("stream"):
            chunks = list(reply)
            assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finish[-1] in ("stop", "length", "tool_calls")
            if (body.get("stream_options") or {}).get("include_usage"):
                assert chunks[-1].usage.prompt_tokens > 0
        else:
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert gw.alive()


def _tool_turns() -> list:
    """Each agent's first request with tools, the tool it then called and the
    call's arguments (from the request that carries the call back)."""
    turns = []
    for folder in (FIXTURES / agent for agent in AGENTS):
        entries = [(p, _load(p)) for p in sorted(folder.glob("*.json"))]
        with_tools = [(p, e) for p, e in entries if e["body"] and e["body"].get("tools")]
        first = with_tools[0][0]
        for message in with_tools[-1][1]["body"]["messages"]:  # the last: it carries the call
            for call in message.get("tool_calls") or []:
                fn = call["function"]
                turns.append(pytest.param(first, fn["name"], json.loads(fn["arguments"]),
                                          id=folder.name))  # fmt: skip
            content = message.get("content")
            for block in content if isinstance(content, list) else []:
                if block.get("type") == "tool_use":
                    turns.append(pytest.param(first, block["name"], block["input"], id=folder.name))
    return turns


def _pinned(tool: dict, args: dict) -> dict:
    """The tool with its required parameters only, each free string pinned to
    the agent's own call's value and each number bounded: a noise model
    writes free text to max_tokens (Qwen3.5's XML call ends a string at its
    closing tag only)."""
    tool = json.loads(json.dumps(tool))
    schema = tool.get("input_schema") or tool.get("function", {}).get("parameters") or {}
    required = set(schema.get("required") or ())
    schema["properties"] = {k: v for k, v in (schema.get("properties") or {}).items()
                            if k in required}  # fmt: skip
    for key, prop in schema["properties"].items():
        if prop.get("type") == "string" and "enum" not in prop:
            prop["enum"] = [args[key]]
        elif prop.get("type") in ("integer", "number"):
            prop["minimum"], prop["maximum"] = 0, 99
    return tool


@pytest.mark.parametrize("path,tool,args", _tool_turns())
def test_a_forced_call_of_the_agents_tool_parses_in_its_sdk(gw, path, tool, args):
    entry = _load(path)
    body = entry["body"] | {"model": "agent", "stream": True}
    body["tools"] = [_pinned(t, args) if tool in (t.get("name"), t.get("function", {}).get("name"))
                     else t for t in body["tools"]]  # fmt: skip
    if entry["path"].startswith("/v1/messages"):
        body |= {"max_tokens": 300, "tool_choice": {"type": "tool", "name": tool,
                                                    "disable_parallel_tool_use": True}}  # fmt: skip
        client = anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0)
        beta = "beta=true" in entry["path"]
        messages = client.beta.messages if beta else client.messages
        kwargs, extra = _split(messages.create, body)
        kwargs.pop("stream")
        with messages.stream(**kwargs, extra_body=extra or None) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use", [getattr(b, "text", b) for b in final.content]
        (use,) = [b for b in final.content if b.type == "tool_use"]
        assert use.name == tool and isinstance(use.input, dict)
        got = use.input
    else:
        named = {"type": "function", "function": {"name": tool}}
        body |= {"max_tokens": 300, "tool_choice": named, "parallel_tool_calls": False}
        client = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
        kwargs, extra = _split(client.chat.completions.stream, body)
        with client.chat.completions.stream(**kwargs, extra_body=extra or None) as stream:
            final = stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == tool
        got = json.loads(call.function.arguments)
    # The agent's own call, as the grammar held it: its required arguments.
    assert got == {k: v for k, v in args.items() if k in got} and got


def test_a_late_system_message_reaches_a_template_that_refuses_it_as_a_user_turn(gw):
    """Claude Code 2.1.332 sends its environment as a system message after the
    first user turn: taken where the template renders it (the demo's), and
    as a user message in place where the template refuses it (Qwen3.5's)."""
    client = anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "system", "content": "# Environment\nPrimary working directory: /w"}]  # fmt: skip
    for model in ("agent", "strict"):
        reply = client.messages.create(model=model, system="Be brief.", messages=messages,
                                       max_tokens=2)  # fmt: skip
        assert reply.usage.input_tokens > 10
    client_oa = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
    late = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Answer in English."}]  # fmt: skip
    assert client_oa.chat.completions.create(model="strict", messages=late, max_tokens=2).choices
    # A template that refuses something else is still a clear 400.
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="agent",
            max_tokens=2,
            messages=[{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
        )
    assert "system message" in err.value.body["error"]["message"]


def test_the_demos_replies_end_at_its_reply_stop(gw):
    """A chat reply of the demo ends at a blank line as at its end of turn
    (Claude Code takes a reply cut at max_tokens for an error); a raw
    completion and a request's own stop strings are as before."""
    oa = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Write a function that adds two numbers."}]
    reply = oa.chat.completions.create(model="demo", messages=ask, max_tokens=400, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 400
    assert "\n\n" not in choice.message.content and choice.message.content
    claude = anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0)
    msg = claude.messages.create(model="demo", messages=ask, max_tokens=400,
                                 extra_body={"temperature": 0})  # fmt: skip
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    assert msg.content[0].text == choice.message.content
    # A stop string the request names is still reported as such.
    first_word = choice.message.content.split()[0]
    named = claude.messages.create(
        model="demo",
        messages=ask,
        max_tokens=400,
        stop_sequences=[first_word],
        extra_body={"temperature": 0},
    )
    assert (named.stop_reason, named.stop_sequence) == ("stop_sequence", first_word)
    # /v1/completions is no reply: it runs past blank lines to max_tokens.
    text = "import os\n\n\ndef main():\n    pass\n\n\n"
    out = oa.completions.create(model="demo", prompt=text, max_tokens=64, temperature=0)
    assert out.choices[0].finish_reason == "length" and "\n\n" in out.choices[0].text
