"""What Continue CLI and aider send, replayed: every request body captured
from the real clients (tests/fixtures/agents/capture_cli.py) goes through
the official openai SDK to a real gateway, is accepted, and its answer
parses in the SDK's own types.

The gateway serves a hand-built tool caller (tests/tool_caller.py) in
Qwen3.5's XML format, whose answer to any chat is a call of Continue's
`Read` tool: one layer, so a Continue prompt of ~2.6k tokens prefills in a
blink (the demo model took 9-15 s for a cold one on this loaded 2-core box; it
meets Continue for real in tests/test_agent_continue.py). Each fixture is
sent as captured but for its model.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import openai
import pytest
from conftest import start_gateway, stop_gateway
from openai.resources.chat.completions import Completions
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tool_caller import XML_TEMPLATE, build_tool_caller

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CAPTURED = sorted((FIXTURES / "continue-1.5.47").glob("*.json")) + sorted(
    (FIXTURES / "aider-0.86.2").glob("*.json")
)
READ_CALL = ("<tool_call>\n<function=Read>\n<parameter=filepath>\nhello.txt\n</parameter>\n"
             "</function>\n</tool_call>")  # fmt: skip
# The SDK's own parameters; anything else a client sent goes as extra_body.
SDK_PARAMS = set(inspect.signature(Completions.create).parameters) - {"self"}


@pytest.fixture(scope="module")
def caller_gateway(tmp_path_factory):
    caller = build_tool_caller(tmp_path_factory.mktemp("caller") / "read", XML_TEMPLATE, READ_CALL)
    gw = start_gateway(
        {"server": {"max_body_bytes": "1MiB"},
         "models": [{"id": "caller", "path": str(caller), "max_context": 16_384}]},
        tmp_path_factory.mktemp("agent-fixtures"),
    )  # fmt: skip
    yield gw
    stop_gateway(gw)


def _replay(client: openai.OpenAI, body: dict):
    body = body | {"model": "caller"}
    known = {k: v for k, v in body.items() if k in SDK_PARAMS}
    extra = {k: v for k, v in body.items() if k not in SDK_PARAMS}
    return client.chat.completions.create(**known, extra_body=extra or None)


def _client_errors(gw) -> list[str]:
    return re.findall(r"specgate\.access: .* status=4\d\d .*", gw.log())


@pytest.mark.parametrize("path", CAPTURED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_captured_request_is_accepted_and_its_answer_parses(caller_gateway, path):
    body = json.loads(path.read_text())
    client = openai.OpenAI(base_url=caller_gateway.api, api_key="unused", max_retries=0)
    offered = {t["function"]["name"] for t in body.get("tools") or []}

    answer = _replay(client, body)  # an error status raises here
    if body.get("stream"):
        # The SDK builds chunks without validating them; validating their
        # fields checks what the gateway sent against the SDK's types.
        chunks = [ChatCompletionChunk.model_validate(c.to_dict()) for c in answer]
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == bool((body.get("stream_options") or {}).get("include_usage"))
        choices = [c.choices[0] for c in chunks if c.choices]
        finish = choices[-1].finish_reason
        text = "".join(c.delta.content or "" for c in choices)
        deltas = [d for c in choices for d in c.delta.tool_calls or []]
        calls = [(d.function.name, json.loads(d.function.arguments)) for d in deltas]
    else:
        message = ChatCompletion.model_validate(answer.to_dict()).choices[0].message
        finish = answer.choices[0].finish_reason
        text = message.content or ""
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in message.tool_calls or []]  # fmt: skip

    if "Read" in offered:  # Continue: the caller's answer comes back as a call of its tool
        assert calls == [("Read", {"filepath": "hello.txt"})] and finish == "tool_calls"
        assert text == ""
    else:  # aider sends no tools: the same answer is text
        assert calls == [] and READ_CALL.startswith(text) and text
        assert finish == ("stop" if text == READ_CALL else "length")
    assert _client_errors(caller_gateway) == []
