"""/v1/responses takes what Codex CLI sends, and answers as Codex expects.

The request bodies of tests/fixtures/agents/codex-0.171.0/ were captured
from the real Codex CLI (tests/fixtures/agents/capture.py): tools of kind
function, namespace, custom (apply_patch, a Lark grammar) and web_search,
reasoning items with encrypted_content, `store: false`, `include`,
`prompt_cache_key`, `text.verbosity`, `client_metadata`. Each is replayed
with the official openai SDK, streamed as Codex streams, and every event
parses into the SDK's own types.

The models are tests/tool_caller.py's lookup checkpoints in Qwen's XML
call format, whose greedy answer is a chosen call: into a namespace, to
Codex's apply_patch, and to a custom tool whose input breaks its grammar
(so the grammar visibly binds it); and a tiny Qwen3.5 hybrid with an MTP
head and the same call format, to hold a custom tool's grammar under MTP
and n-gram speculation, greedy, to plain decoding's output.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway
from openai.resources.responses import Responses
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseCustomToolCallInputDeltaEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
)
from openai.types.responses.response_output_item import LocalShellCall
from tool_caller import XML_TEMPLATE, build_tool_caller

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.gateway.api.chat import late_system_as_user

FIXTURES = Path(__file__).parent / "fixtures" / "agents" / "codex-0.171.0"
CAPTURED = sorted(p.stem for p in FIXTURES.glob("*.json"))
CALL = "<tool_call>\n<function={}>\n<parameter={}>\n{}\n</parameter>\n</function>\n</tool_call>"
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
SHOUT_LARK = 'start: WORDS "!"\nWORDS: /[a-z]+( [a-z]+)*/\n'
SHOUT_REGEX = "[a-z]+( [a-z]+)*!"
ASK = "Shout hello world."
# Bounded, so that a random model's forced input ends within a few tokens.
SHORT_LARK = 'start: WORD (" " WORD){0,2} "!"\nWORD: /[a-z]{1,8}/\n'
SHORT_REGEX = "[a-z]{1,8}( [a-z]{1,8}){0,2}!"


FIRST_SYSTEM_ONLY = (
    "{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}"
    "{%- endif -%}{%- endfor -%}"
)


def _xml_model(root: Path, answer: str) -> Path:
    return build_tool_caller(root, XML_TEMPLATE, answer)


def _hybrid_xml(root: Path) -> Path:
    path = build_qwen35_hybrid(root)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps(config | {"chat_template": XML_TEMPLATE})
    )
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("codex-models")
    models = {
        "ns": _xml_model(root / "ns", CALL.format("multi_agent_v1__close_agent", "target", "a1")),
        "shell": _xml_model(root / "shell", CALL.format("local_shell", "command", '["ls", "-a"]')),
        "patch": _xml_model(root / "patch", CALL.format("apply_patch", "input", PATCH)),
        "shout": _xml_model(root / "shout", CALL.format("shout", "input", "hello world")),
        # Qwen's templates refuse a system message anywhere but first.
        "strict": build_tool_caller(root / "strict", FIRST_SYSTEM_ONLY + XML_TEMPLATE, "ok"),
    }
    config = {"models": [
        {"id": "ns", "path": str(models["ns"]), "max_context": 32768},
        {"id": "patch", "path": str(models["patch"]), "max_context": 4096},
        {"id": "shell", "path": str(models["shell"]), "max_context": 4096},
        {"id": "strict", "path": str(models["strict"]), "max_context": 4096},
        {"id": "shout", "path": str(models["shout"]), "max_context": 2048,
         "engines": ["mlx_plain", "mlx_ngram"]},
        {"id": "hybrid", "path": str(_hybrid_xml(root / "hybrid")), "max_context": 2048,
         "engines": ["mlx_plain", "mlx_mtp", "mlx_ngram"]},
    ]}  # fmt: skip
    gw = start_gateway(config, tmp_path_factory.mktemp("codex-gateway"))
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=120)


_SDK_PARAMS = set(inspect.signature(Responses.create).parameters)


def as_sdk_call(body: dict, model: str) -> dict:
    """A captured body as `responses.create` keywords: what the SDK names as
    parameters, the rest (Codex's client_metadata) as extra_body."""
    body = body | {"model": model}
    known = {k: v for k, v in body.items() if k in _SDK_PARAMS}
    extra = {k: v for k, v in body.items() if k not in _SDK_PARAMS}
    return known | ({"extra_body": extra} if extra else {})


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def streamed(client, **kw) -> list:
    events = list(client.responses.create(**kw))
    # Every event is one of the SDK's own types (an unknown type would come
    # back as a bare object), numbered in order, and the last ends it.
    assert all(type(e).__module__.startswith("openai.types.responses") for e in events), [
        type(e) for e in events]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert isinstance(events[-1], ResponseCompletedEvent | ResponseIncompleteEvent), events[-1]
    return events


def test_the_captures_hold_what_codex_sends():
    """What the fixtures must show, so the replays below test it."""
    assert {"fallback-00", "catalog-00", "catalog-03"} <= set(CAPTURED)
    first, last = fixture("catalog-00"), fixture("catalog-03")
    kinds = {t["type"] for t in first["tools"]}
    assert {"function", "namespace", "custom", "web_search"} <= kinds
    assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
    assert first["text"] == {"verbosity": "low"} and "prompt_cache_key" in first
    items = {i["type"] for i in last["input"]}
    assert {"reasoning", "function_call", "function_call_output", "custom_tool_call",
            "custom_tool_call_output"} <= items  # fmt: skip
    assert any(i.get("namespace") == "multi_agent_v1" for i in last["input"])


@pytest.mark.parametrize("name", CAPTURED)
def test_every_captured_request_is_accepted_and_a_namespace_call_routed_back(client, name):
    """Whole, as captured (9k to 17k tokens; the later turns of a capture
    resume from the earlier ones' prefix-cache entries). The model calls a
    namespace's tool by its flattened name; Codex gets it under the
    namespace, the only form it routes (and sends back, as in the captures'
    later turns)."""
    events = streamed(client, **as_sdk_call(fixture(name), "ns"))
    final = events[-1].response
    (call,) = final.output
    assert isinstance(call, ResponseFunctionToolCall)
    assert (call.namespace, call.name, json.loads(call.arguments)) == (
        "multi_agent_v1", "close_agent", {"target": "a1"})  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].namespace == "multi_agent_v1"
    assert final.store is False and "web_search" in [t.type for t in final.tools]
    assert final.usage.input_tokens > 8000


def codex_tools(*names: str) -> list[dict]:
    """Tools of the capture with these names."""
    return [t for t in fixture("catalog-00")["tools"] if t.get("name") in names]


def test_local_shell_calls_come_back_as_local_shell_calls(client):
    """A local_shell tool's call is a local_shell_call with an exec action;
    offered no such tool, the same call is a function_call by that name,
    for the client to refuse."""
    first = client.responses.create(
        model="shell", input="List files.", tools=[{"type": "local_shell"}]
    )
    (shell,) = first.output
    assert isinstance(shell, LocalShellCall)
    assert (shell.action.type, shell.action.command) == ("exec", ["ls", "-a"])
    # The call and its output sent back: the conversation goes on.
    again = client.responses.create(model="shell", tools=[{"type": "local_shell"}], input=[
        {"role": "user", "content": "List files."}, shell.model_dump(exclude_none=True),
        {"type": "local_shell_call_output", "id": shell.call_id, "output": "a.txt"}])  # fmt: skip
    assert again.usage.input_tokens > first.usage.input_tokens
    unoffered = client.responses.create(model="shell", input="List files.", tools=codex_tools(
        "exec_command"))  # fmt: skip
    assert [(o.type, o.name) for o in unoffered.output] == [("function_call", "local_shell")]


def test_a_custom_tool_call_comes_back_as_codex_sends_it_on(client):
    """Codex's apply_patch (a custom tool, its Lark grammar as captured):
    the model's patch is the call's input, exactly, streamed as input
    deltas; the next turn carries the call and its output back."""
    kw = dict(
        model="patch", input="Write hello.txt.", tools=codex_tools("exec_command", "apply_patch")
    )
    events = streamed(client, **kw, stream=True)
    (call,) = [o for o in events[-1].response.output if o.type == "custom_tool_call"]
    assert isinstance(call, ResponseCustomToolCall)
    assert (call.name, call.input, call.namespace) == ("apply_patch", PATCH, None)
    deltas = [e for e in events if isinstance(e, ResponseCustomToolCallInputDeltaEvent)]
    assert "".join(e.delta for e in deltas) == PATCH
    with client.responses.stream(**kw) as stream:  # the SDK's own accumulator
        final = stream.get_final_response()
    assert [(o.type, o.input) for o in final.output] == [("custom_tool_call", PATCH)]

    again = client.responses.create(
        **kw
        | {
            "input": [
                {"role": "user", "content": kw["input"]},
                call.model_dump(exclude_none=True),
                {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success."},
            ]
        }
    )
    assert again.status == "completed"
    assert again.usage.input_tokens > events[-1].response.usage.input_tokens


def drafted(gateway, method: str, model: str) -> float:
    """Draft tokens proposed so far (the gateway's Prometheus counter)."""
    metric = f'specgate_spec_decode_num_draft_tokens_total{{method="{method}",model="{model}"}}'
    lines = httpx.get(gateway.base_url + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(metric))


def shout_tool(grammar: str | None, syntax: str = "lark") -> dict:
    fmt = {"type": "text"} if grammar is None else {
        "type": "grammar", "syntax": syntax, "definition": grammar}  # fmt: skip
    return {"type": "custom", "name": "shout", "description": "Say it loud.", "format": fmt}


def shout(client, tool: dict, method: str = "none", **kw):
    raw = client.responses.with_raw_response.create(
        model="shout", input=ASK, tools=[tool], temperature=0, max_output_tokens=64,
        extra_headers={"X-Specgate-Method": method}, **kw)  # fmt: skip
    response = raw.parse()
    assert response.status == "completed"
    return response, raw.headers["x-specgate-plan"]


@pytest.mark.parametrize("syntax,grammar", [("lark", SHOUT_LARK), ("regex", SHOUT_REGEX)])
def test_a_custom_tools_grammar_binds_its_input_among_free_text(gateway, client, syntax, grammar):
    """tool_choice auto: the output is free text or calls, and only the
    custom tool's input is held to its grammar. The model's own input
    ("hello world") lacks the "!" the grammar ends with: held, it gets one
    (greedy picks the grammar's first way on), and n-gram speculation
    (copying "hello world" from the prompt) writes the same."""
    free, _ = shout(client, shout_tool(None))
    assert [(o.type, o.input) for o in free.output] == [("custom_tool_call", "hello world")]
    held, _ = shout(client, shout_tool(grammar, syntax))
    (call,) = held.output
    assert call.type == "custom_tool_call" and re.fullmatch(SHOUT_REGEX, call.input), call
    assert call.input.startswith("hello world")
    before = drafted(gateway, "ngram", "shout")
    spec, plan = shout(client, shout_tool(grammar, syntax), method="ngram")
    assert "method=ngram" in plan and drafted(gateway, "ngram", "shout") > before
    assert spec.output[0].input == call.input
    assert spec.usage.output_tokens == held.usage.output_tokens


@pytest.mark.parametrize("syntax,grammar", [("lark", SHORT_LARK), ("regex", SHORT_REGEX)])
def test_a_forced_custom_tool_is_exact_under_speculation(gateway, client, syntax, grammar):
    """A custom tool forced (tool_choice {"type": "custom"}) on a random
    Qwen3.5 hybrid: its input is the grammar's, greedy, the same with MTP
    and n-gram drafts as plain."""
    outs, before = {}, drafted(gateway, "mtp", "hybrid")
    for method in ("none", "mtp", "ngram"):
        raw = client.responses.with_raw_response.create(
            model="hybrid", input=ASK, tools=[shout_tool(grammar, syntax)], temperature=0,
            tool_choice={"type": "custom", "name": "shout"}, parallel_tool_calls=False,
            max_output_tokens=96,
            extra_headers={"X-Specgate-Method": method, "X-Specgate-Depth": "3"})  # fmt: skip
        assert f"method={method}" in raw.headers["x-specgate-plan"]
        response = raw.parse()
        assert response.status == "completed", response.output
        ((kind, text),) = outs[method] = [
            (o.type, getattr(o, "input", None)) for o in response.output
        ]
        assert kind == "custom_tool_call" and re.fullmatch(SHORT_REGEX, text), outs
    assert outs["mtp"] == outs["none"] == outs["ngram"], outs
    assert drafted(gateway, "mtp", "hybrid") > before  # the head drafted under the grammar


def test_a_developer_message_mid_session_reaches_a_template_that_refuses_it(client):
    """Codex sends developer messages later in a session (a changed sandbox,
    a new working directory); Qwen's templates refuse a system message past
    the first. The template refused, they are read as the user's: served."""
    turn = [
        {"role": "developer", "content": "You are a coding agent."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "developer", "content": "The working directory is now /tmp/x."},
        {"role": "user", "content": "Go on."},
    ]
    r = client.responses.create(model="strict", input=turn, max_output_tokens=4)
    assert r.status == "completed"
    chat = client.chat.completions.create(
        model="strict", max_tokens=4,
        messages=[{"role": "system" if m["role"] == "developer" else m["role"],
                   "content": m["content"]} for m in turn])  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_late_system_messages_become_the_users_and_nothing_else_moves():
    first = {"role": "system", "content": "a"}
    late = {"role": "system", "content": "b"}
    talk = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "x"}]
    assert late_system_as_user([first, *talk]) is None
    assert late_system_as_user([first, first | {"content": "a2"}, *talk]) is None  # leading
    assert late_system_as_user([first, *talk, late]) == [first, *talk, late | {"role": "user"}]


def test_hosted_tools_are_left_out_and_the_request_served(client):
    tools = [{"type": "web_search", "external_web_access": True}, {"type": "file_search",
             "vector_store_ids": ["vs_1"]}, {"type": "image_generation"}]  # fmt: skip
    # None of them reaches the model: it is asked with no tools at all.
    r = client.responses.create(
        model="hybrid",
        input="hi",
        tools=tools,
        max_output_tokens=4,
        include=["web_search_call.action.sources"],
    )
    assert r.status == "incomplete" and r.output[0].type == "message"
    assert [t.type for t in r.tools] == ["web_search", "file_search", "image_generation"]


def test_images_and_records_in_the_input_do_not_end_the_session(client):
    """A view_image result (an image in a tool's output) and a hosted tool's
    record Codex may send back: accepted, the image a line of text."""
    input_ = [
        {"role": "user", "content": "Look at the picture."},
        {"type": "function_call", "call_id": "c1", "name": "view_image",
         "arguments": json.dumps({"path": "a.png"})},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "x"}},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
    ]  # fmt: skip
    r = client.responses.create(model="ns", input=input_, max_output_tokens=8)
    assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize("tools,param,code", [
    ([shout_tool("start: (", "lark")], "tools.0.format.definition", "invalid_grammar"),
    ([shout_tool("([a-z", "regex")], "tools.0.format.definition", "invalid_grammar"),
    # Hostile: nested past what a recursive compiler survives (the sandbox's child takes it).
    ([shout_tool("start: " + "(" * 20000 + '"a"' + ")" * 20000)], "tools.0.format.definition",
     "invalid_grammar"),
    ([shout_tool("(" * 20000 + "a" + ")" * 20000, "regex")], "tools.0.format.definition",
     "invalid_grammar"),
    ([{"type": "namespace", "name": "ns", "description": "d", "tools": [shout_tool("start: (")]}],
     "tools.0.tools.0.format.definition", "invalid_grammar"),
    ([{"type": "namespace", "name": "ns", "description": "d", "tools": [
        {"type": "function", "name": "f"}]}, {"type": "function", "name": "ns__f"}], "tools", None),
    ([{"type": "warp_drive"}], "tools.0", None),
])  # fmt: skip
def test_bad_tools_are_openai_400s(client, tools, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="shout", input=ASK, tools=tools, max_output_tokens=4)
    body = e.value.body
    assert body["type"] == "invalid_request_error", body
    assert (body["param"] or "").startswith(param) or f"{param}" in body["message"], body
    if code:
        assert body["code"] == code and body["param"] == param, body
    assert client.responses.create(model="shout", input=ASK, max_output_tokens=4).status
