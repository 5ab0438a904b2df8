"""Structured outputs: what an API request asks its output to be, as one
grammar (engines/base.OutputConstraint) every engine masks by.

- `response_format` / `text.format`: one JSON value (json_object: any
  object; json_schema: the schema's);
- a forced tool call (OpenAI `tool_choice` "required" or a named function,
  Anthropic `any` or `tool`): one or more calls in the model's own format
  (gateway/api/tools.py), each a listed function with arguments of its schema;
- JSON output with tools left to the model: the JSON value or the calls.

Grammars are llguidance's Lark dialect, with the JSON parts inlined as
`%json{...}` schemas; the JSON layout is the one templates render (", " and
": " separators, no other whitespace), so a forced call reads like the
calls the model saw in training.

A request's schemas are strangers' input to a native compiler: each is
bounded first (engines/grammar/bounds.py: depth with `$ref`s followed,
width, size, loops), the grammar is built on the CPU workers, and it is
compiled once in the sandbox (engines/grammar/sandbox.py) before the
request is admitted, so every refusal is a 400 before a byte streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from specgate.engines.base import Engine, OutputConstraint
from specgate.engines.cpu import run_cpu
from specgate.engines.grammar.bounds import LIMITS, check_schema
from specgate.engines.grammar.matcher import (
    JSON_OPTIONS,
    GrammarError,
    json_constraint,
    lark_constraint,
)
from specgate.gateway.api.tools import CALL_END, CALL_START, GRAMMAR_FORMATS, ToolFormat
from specgate.gateway.errors import APIError


@dataclass(frozen=True)
class JsonOutput:
    """The output is one JSON value: `schema`'s, or any object when None."""

    schema: dict | None
    param: str


@dataclass(frozen=True)
class ForcedTools:
    """The output is tool calls: to `name` only, or to any of the tools."""

    tools: list[dict]  # OpenAI-shaped: {"type": "function", "function": {...}}
    name: str | None
    parallel: bool  # more than one call allowed
    param: str


async def checked_constraint(
    engine: Engine,
    json_output: JsonOutput | None,
    forced: ForcedTools | None,
    tools: list[dict],
    fmt: ToolFormat | None,
) -> OutputConstraint | None:
    """`constraint()`, built on the CPU workers and compiled in the
    engine's sandbox: a 400 naming the parameter where it cannot be."""
    output = await run_cpu(constraint, json_output, forced, tools, fmt)
    if output is not None:
        try:
            await engine.check_constraint(output)
        except GrammarError as e:
            raise APIError(400, str(e), param=output.param, code="invalid_schema") from None
    return output


def constraint(
    json_output: JsonOutput | None,
    forced: ForcedTools | None,
    tools: list[dict],
    fmt: ToolFormat | None,
) -> OutputConstraint | None:
    """The request's grammar, or None; a 400 naming the parameter where it
    cannot be built. `tools` and `fmt`: the tools the model may call of its
    own accord (with JSON output, the output is then the value or calls)."""
    try:
        if forced is not None:
            if json_output is not None:
                raise APIError(400, f"{json_output.param}: cannot be combined with a forced tool "
                                    f"call ({forced.param})", param=json_output.param)  # fmt: skip
            chosen = [t for t in forced.tools if forced.name in (None, _name(t))]
            if not chosen:
                raise APIError(400, f"{forced.param}: no tool named '{forced.name}' in tools",
                               param=forced.param)  # fmt: skip
            _check_format(fmt, forced.param)
            _check_tools(chosen, forced.param)
            lark = f"start: {_calls_rule(chosen, fmt, forced.parallel)}\n{_call_rules(chosen, fmt)}"
            grammar = lark_constraint(lark, forced.param)
            if fmt == "hermes" and not forced.parallel:
                # One JSON call between fixed tags: also a JSON schema, which
                # llama-server can take.
                schema = json.dumps({"anyOf": _hermes_calls(chosen)})
                grammar = replace(grammar, json_schema=schema, prefix=CALL_START + "\n",
                                  suffix="\n" + CALL_END)  # fmt: skip
            return grammar
        if json_output is None:
            return None
        if json_output.schema is not None:
            check_schema(json_output.schema, json_output.param)
        if not tools or fmt is None:
            return json_constraint(json_output.schema, json_output.param)
        _check_format(fmt, json_output.param)
        _check_tools(tools, json_output.param)
        value = _inline_json(json_output.schema or {"type": "object"})
        lark = f"start: {value} | {_calls_rule(tools, fmt, True)}\n{_call_rules(tools, fmt)}"
        return lark_constraint(lark, json_output.param)
    except GrammarError as e:
        raise APIError(400, str(e), param=(forced or json_output).param,
                       code="invalid_schema") from None  # fmt: skip


def _check_tools(tools: list[dict], param: str) -> None:
    """Bound what the grammar is built from: the tools' count and each
    one's parameters schema (bounds.py)."""
    if len(tools) > LIMITS.width:
        raise GrammarError(f"{param}: {len(tools)} tools to hold the output to, more than "
                           f"{LIMITS.width}")  # fmt: skip
    for tool in tools:
        check_schema(_parameters(tool), f"{param}: tool '{_name(tool)[:64]}' parameters")


def _hermes_calls(tools: list[dict]) -> list[dict]:
    """A hermes call's JSON object per tool: its name, its arguments' schema."""
    return [
        {"type": "object",
         "properties": {"name": {"const": _name(t)}, "arguments": _parameters(t)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools
    ]  # fmt: skip


def _name(tool: dict) -> str:
    return tool["function"]["name"]


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal: JSON's escapes


def _inline_json(schema: dict) -> str:
    return "%json" + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _check_format(fmt: ToolFormat | None, param: str) -> None:
    if fmt not in GRAMMAR_FORMATS:
        raise GrammarError(f"{param}: holding the output to tool calls is supported for models "
                           "that call tools in Qwen's JSON (hermes) or XML format, not in "
                           f"{fmt or 'an unknown'} format")


def _calls_rule(tools: list[dict], fmt: ToolFormat, parallel: bool) -> str:
    return 'call ("\\n" call)*' if parallel else "call"


def _call_rules(tools: list[dict], fmt: ToolFormat) -> str:
    if fmt == "hermes":
        return f"call: {_CALL_OPEN} {_inline_json({'anyOf': _hermes_calls(tools)})} {_CALL_CLOSE}\n"
    # qwen3_xml: <function=NAME>, then its parameters in the schema's order.
    functions = " | ".join(f"fn{i}" for i in range(len(tools)))
    rules = [f"call: {_CALL_OPEN} ({functions}) {_FUNCTION_CLOSE} {_CALL_CLOSE}"]
    for i, tool in enumerate(tools):
        schema = _parameters(tool)
        required = set(schema.get("required") or ())
        parts = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rule, sub = f"fn{i}_p{j}", sub if isinstance(sub, dict) else {}
            head = _literal(f"<parameter={key}>\n")
            if sub.get("type") == "string" and "enum" in sub:
                choices = " | ".join(_literal(str(v)) for v in sub["enum"])
                rules.append(f"{rule}: {head} ({choices}) {_PARAMETER_CLOSE}")
            elif sub.get("type") == "string":  # text, up to the closing tag its suffix writes
                rules.append(f"{rule}: {head} {rule}_text")
                rules.append(f"{rule}_text[suffix={_PARAMETER_CLOSE}]: /(.|\\n)*/")
            else:  # JSON text, as the template renders numbers, objects and arrays
                rules.append(f"{rule}: {head} {_inline_json(sub)} {_PARAMETER_CLOSE}")
            parts.append(rule if key in required else f"{rule}?")
        head = _literal(f"<function={_name(tool)}>\n")
        rules.append(f"fn{i}: {head} {' '.join(parts)}")
    return "\n".join(rules) + "\n"


_CALL_OPEN = _literal(CALL_START + "\n")
_CALL_CLOSE = _literal("\n" + CALL_END)
_FUNCTION_CLOSE = _literal("</function>")
_PARAMETER_CLOSE = _literal("\n</parameter>\n")
