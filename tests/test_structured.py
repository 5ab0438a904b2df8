"""The grammars behind structured outputs (specgate/gateway/api/structured.py), checked
with llguidance against text in each tool-call format: what the model's
template would write is accepted, and parses back to the same call; what
breaks the schema is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from mlx_lm.tokenizer_utils import load

from specgate.engines.grammar.matcher import GrammarError, json_constraint
from specgate.engines.grammar.sandbox import GrammarSandbox
from specgate.gateway.api.structured import ForcedTools, JsonOutput, constraint
from specgate.gateway.api.tools import parse_call
from specgate.gateway.errors import APIError

DEMO = Path(__file__).parents[1] / "specgate" / "engines" / "checkpoints" / "demo"
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer"},
                       "mode": {"type": "string", "enum": ["text", "bytes"]}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "list_dir", "parameters": {
        "type": "object", "properties": {"recursive": {"type": "boolean"}}}}},
]


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


HERMES = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "limit": 3}}\n</tool_call>'
XML = ("<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/<a>.py\nline 2\n</parameter>\n"
       "<parameter=limit>\n3\n</parameter>\n<parameter=mode>\nbytes\n</parameter>\n"
       "</function>\n</tool_call>")


@pytest.mark.parametrize("fmt,text", [("hermes", HERMES), ("qwen3_xml", XML)])
def test_forced_calls_accept_the_template_format(tokenizer, fmt, text):
    c = constraint(None, ForcedTools(TOOLS, None, True, "tool_choice"), TOOLS, fmt)
    assert accepts(tokenizer, c.grammar, text)
    assert accepts(tokenizer, c.grammar, text + "\n" + text)  # parallel calls
    body = text[len("<tool_call>") : -len("</tool_call>")]
    (call,) = parse_call(body, fmt, TOOLS)
    assert call.name == "read_file" and call.arguments["limit"] == 3
    named = constraint(None, ForcedTools(TOOLS, "list_dir", False, "tool_choice"), TOOLS, fmt)
    assert not accepts(tokenizer, named.grammar, text)  # another function
    single = constraint(None, ForcedTools(TOOLS, None, False, "tool_choice"), TOOLS, fmt)
    assert not accepts(tokenizer, single.grammar, text + "\n" + text)
    assert not accepts(tokenizer, c.grammar, text.replace("3", '"three"', 1))  # wrong type
    assert not accepts(tokenizer, c.grammar, "Sure! " + text)  # nothing before the call


def test_xml_enum_and_required(tokenizer):
    c = constraint(None, ForcedTools(TOOLS, "read_file", False, "tool_choice"), TOOLS, "qwen3_xml")
    assert not accepts(tokenizer, c.grammar, XML.replace("bytes", "words"))
    no_path = XML.replace("<parameter=path>\nsrc/<a>.py\nline 2\n</parameter>\n", "")
    assert not accepts(tokenizer, c.grammar, no_path)


def test_json_output_with_tools_left_to_the_model(tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    c = constraint(JsonOutput(schema, "response_format"), None, TOOLS, "hermes")
    assert accepts(tokenizer, c.grammar, '{"ok": true}')
    assert accepts(tokenizer, c.grammar, HERMES)
    assert not accepts(tokenizer, c.grammar, '{"ok": 1}')
    alone = constraint(JsonOutput(schema, "response_format"), None, [], None)
    assert alone.json_schema is not None and accepts(tokenizer, alone.grammar, '{"ok": false}')
    any_object = constraint(JsonOutput(None, "response_format"), None, [], None)
    assert accepts(tokenizer, any_object.grammar, '{"a": [1, 2, {"b": null}]}')
    assert not accepts(tokenizer, any_object.grammar, "[1]")


async def _sandboxed(grammar: str, param: str) -> None:
    sandbox = GrammarSandbox()
    try:
        await sandbox.check(grammar, param, None)
    finally:
        await sandbox.close()


def test_errors_name_the_parameter():
    # A schema llguidance refuses is built, and refused where it compiles
    # (the sandbox, before the request is admitted: test_hostile_schemas.py).
    bad = constraint(JsonOutput({"type": "no-such-type"}, "response_format"), None, [], None)
    with pytest.raises(GrammarError, match="^response_format: "):
        asyncio.run(_sandboxed(bad.grammar, bad.param))
    with pytest.raises(APIError) as e:
        constraint(None, ForcedTools(TOOLS, "nope", False, "tool_choice"), TOOLS, "hermes")
    assert e.value.param == "tool_choice" and "nope" in str(e.value)
    with pytest.raises(APIError) as e:
        constraint(JsonOutput(None, "response_format"), ForcedTools(TOOLS, None, True, "tool_choice"),
                   TOOLS, "hermes")
    assert e.value.param == "response_format"
    assert json_constraint(None, "x").json_schema == '{"type": "object"}'
