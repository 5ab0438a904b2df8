"""Structured outputs: what an API request asks its output to be, as one
grammar (engines/base.OutputConstraint) every engine masks by.

- `response_format` / `text.format`: one JSON value (json_object: any
  object; json_schema: the schema's);
- a forced tool call (OpenAI `tool_choice` "required" or a named function,
  Anthropic `any` or `tool`): one or more calls in the model's own format
  (gateway/api/tools.py), each a listed function with arguments of its schema;
- JSON output with tools left to the model: the JSON value or the calls;
- tools left to the model through specgate's tool-use prompt (a template
  without tools, `tool_prompt: default`): text, or text then hermes calls
  (`checked_prompted_calls`);
- a Responses `custom` tool's input held to its own grammar (Lark or a
  regular expression, `ToolGrammar`): inside a forced call, and with tools
  left to the model (`checked_tool_inputs`) as free text or calls, where
  only a call to that tool is bound, and only its input.

A client's own grammar is embedded whole, as a grammar of its own that the
call's rules refer to (`@name`: its rules and `%import`s cannot meet ours).
Only Qwen's XML call format carries a tool's input as raw text; in the JSON
(hermes) format it is a JSON string, which a Lark grammar cannot describe,
so there a custom tool's input is not held to its grammar.

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
import logging
from dataclasses import dataclass, replace

from specgate.engines.base import Engine, OutputConstraint, SamplingParams
from specgate.engines.cpu import run_cpu
from specgate.engines.grammar.bounds import LIMITS, check_schema
from specgate.engines.grammar.matcher import (
    JSON_OPTIONS,
    GrammarError,
    json_constraint,
    lark_constraint,
    regex_as_lark,
)
from specgate.gateway.api.tools import CALL_END, CALL_START, GRAMMAR_FORMATS, ToolFormat
from specgate.gateway.errors import APIError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JsonOutput:
    """The output is one JSON value: `schema`'s, or any object when None."""

    schema: dict | None
    param: str


@dataclass(frozen=True)
class ToolGrammar:
    """A custom tool's input held to a grammar, as the client wrote it:
    `syntax` "lark" (llguidance's Lark dialect) or "regex" (Rust `regex`
    syntax); `param` names where the request gave it."""

    syntax: str
    definition: str
    param: str

    def as_lark(self) -> str:
        return self.definition if self.syntax == "lark" else regex_as_lark(self.definition)


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
    grammars: dict[str, ToolGrammar] | None = None,
) -> OutputConstraint | None:
    """`constraint()`, built on the CPU workers and compiled in the
    engine's sandbox: a 400 naming the parameter where it cannot be.
    `grammars`: custom tools' input grammars by tool name, each compiled
    alone first, so that a bad one is a 400 naming that tool."""
    for grammar in (grammars or {}).values():
        await _compiled(engine, lark_constraint(grammar.as_lark(), grammar.param), "invalid_grammar")
    output = await run_cpu(constraint, json_output, forced, tools, fmt, grammars)
    if output is not None:
        await _compiled(engine, output, "invalid_schema")
    return output


async def checked_tool_inputs(
    engine: Engine,
    tools: list[dict],
    fmt: ToolFormat | None,
    grammars: dict[str, ToolGrammar],
    sampling: SamplingParams,
) -> OutputConstraint | None:
    """With tools left to the model and custom tools among them, the output
    as free text or tool calls, where a call to a custom tool has an input of
    its grammar (checked_constraint checked each grammar already). None where
    that cannot be held: no such tool, a call format other than Qwen's XML,
    an engine that cannot serve the grammar exactly (llama-server samples
    first); the input is then the model's own, and a debug log says so."""
    if not grammars or not tools:
        return None
    if fmt != "qwen3_xml":
        log.debug("custom tools %s: inputs not held to their grammars (the model calls tools in "
                  "%s format, which carries them as JSON strings)", sorted(grammars), fmt)  # fmt: skip
        return None
    output = await run_cpu(_tool_inputs, tools, grammars)
    refusal = engine.refusal(replace(sampling, constraint=output))
    if refusal is not None:
        log.debug("custom tools %s: inputs not held to their grammars: %s", sorted(grammars),
                  refusal.message)  # fmt: skip
        return None
    await _compiled(engine, output, "invalid_grammar")
    return output


async def checked_prompted_calls(
    engine: Engine, tools: list[dict], parallel: bool, sampling: SamplingParams
) -> OutputConstraint | None:
    """With tools left to the model through specgate's tool-use prompt
    (tools.tools_as_text), the output as text, or text then calls
    whose arguments follow each tool's schema (`_text_then_calls`), so a
    call the model starts always parses. None where the engine cannot hold
    it exactly (llama-server above temperature 0, or any Lark grammar: it
    takes one JSON schema); the calls are then the model's own, parsed as
    written, and a debug log says so, as for custom tools' inputs."""
    if not tools:
        return None
    output = await run_cpu(_prompted_calls, tools, parallel)
    refusal = engine.refusal(replace(sampling, constraint=output))
    if refusal is not None:
        log.debug("tools through the tool-use prompt: calls not held to the tools' schemas: %s",
                  refusal.message)  # fmt: skip
        return None
    await _compiled(engine, output, "invalid_schema")
    return output


def _prompted_calls(tools: list[dict], parallel: bool) -> OutputConstraint:
    try:
        _check_tools(tools, "tools")
        return _text_then_calls(tools, parallel)
    except GrammarError as e:
        raise APIError(400, str(e), param="tools", code="invalid_schema") from None


def _text_then_calls(tools: list[dict], parallel: bool) -> OutputConstraint:
    """Free text, or text up to a call's opening tag and then hermes calls,
    one (or, `parallel`, more, a newline apart) to end the output.

    The text never says the opening tag but where a call opens (else the
    tool-call parser would take that for a call's start, and the call after
    it for that call's body): TEXT is text without it (llguidance's `&` and
    `~` on regular expressions), and TEXT_TO_CALL such text then the tag,
    one lexeme, so the lexer need not guess where the text ends."""
    calls = '("\\n" call)*' if parallel else ""
    rules = [
        f"start: TEXT | TEXT_TO_CALL call_body {calls}",
        f"TEXT_TO_CALL: TEXT {_CALL_OPEN}",
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_CALL_START_RX}(.|\\n)*/",
        f"call: {_CALL_OPEN} call_body",
        f"call_body: {_inline_json({'anyOf': _hermes_calls(tools)})} {_CALL_CLOSE}",
    ]
    return lark_constraint("\n".join(rules) + "\n", "tools")


async def _compiled(engine: Engine, output: OutputConstraint, code: str) -> None:
    try:
        await engine.check_constraint(output)
    except GrammarError as e:
        raise APIError(400, str(e), param=output.param, code=code) from None


def constraint(
    json_output: JsonOutput | None,
    forced: ForcedTools | None,
    tools: list[dict],
    fmt: ToolFormat | None,
    grammars: dict[str, ToolGrammar] | None = None,
) -> OutputConstraint | None:
    """The request's grammar, or None; a 400 naming the parameter where it
    cannot be built. `tools` and `fmt`: the tools the model may call of its
    own accord (with JSON output, the output is then the value or calls);
    `grammars`: custom tools' input grammars by tool name."""
    grammars = grammars or {}
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
            rules, subgrammars = _call_rules(chosen, fmt, grammars)
            lark = f"start: {_calls_rule(chosen, fmt, forced.parallel)}\n{rules}"
            grammar = lark_constraint(lark, forced.param, subgrammars)
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
        rules, subgrammars = _call_rules(tools, fmt, grammars)
        lark = f"start: {value} | {_calls_rule(tools, fmt, True)}\n{rules}"
        return lark_constraint(lark, json_output.param, subgrammars)
    except GrammarError as e:
        raise APIError(400, str(e), param=(forced or json_output).param,
                       code="invalid_schema") from None  # fmt: skip


def _tool_inputs(tools: list[dict], grammars: dict[str, ToolGrammar]) -> OutputConstraint:
    """Free text and tool calls in Qwen's XML format, where a call to a tool
    of `grammars` is that tool's one parameter, `input`, in its grammar.

    Text is lazy up to a call's opening tag, or, last, text that never says
    it (`&` and `~`: llguidance's intersection and complement of regular
    expressions), so no call escapes the grammar inside text. A call to any
    other tool is left as the model writes it, up to its closing tag."""
    names = [_name(t) for t in tools]
    bound = [n for n in names if n in grammars]
    subgrammars = {f"g{i}": grammars[n].as_lark() for i, n in enumerate(bound)}
    rules = [
        "start: (text_to_call call)* TEXT",
        f"text_to_call[lazy]: /(.|\\n)*{_CALL_OPEN_RX}/",
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_CALL_START_RX}(.|\\n)*/",
    ]
    # Every call opens with the same lexeme, then the name: a bound tool's
    # name as a literal, any other as OTHER_NAME, both read from one place
    # (llguidance's lexer is greedy: a literal `<function=NAME>` would hold
    # on to a longer name that only starts like NAME).
    calls = [f"bound{i}" for i in range(len(bound))]
    for i, name in enumerate(bound):
        rules.append(f"bound{i}: {_FUNCTION_OPEN} {_literal(name)} {_INPUT_HEAD} @g{i} "
                     f"{_literal(_INPUT_CLOSE)}")  # fmt: skip
    if len(bound) < len(names):  # the other tools, by any name but those
        calls.append("other")
        rules.append(f"other: {_FUNCTION_OPEN} OTHER_NAME {_literal('>')} other_body")
        rules.append(f"OTHER_NAME: /[^>\\n]+/ & ~/({'|'.join(bound)})/")
        rules.append(f"other_body[lazy]: /(.|\\n)*\\n{_CALL_END_RX}/")
    rules.append(f"call: {' | '.join(calls)}")
    return lark_constraint("\n".join(rules) + "\n", "tools", subgrammars)


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


def _call_rules(tools: list[dict], fmt: ToolFormat, grammars: dict[str, ToolGrammar]
                ) -> tuple[str, dict[str, str]]:  # fmt: skip
    """The `call` rule and those it uses, and the client grammars they refer
    to by name (a custom tool's input, in the XML format only)."""
    if fmt == "hermes":
        rule = f"call: {_CALL_OPEN} {_inline_json({'anyOf': _hermes_calls(tools)})} {_CALL_CLOSE}\n"
        return rule, {}
    # qwen3_xml: <function=NAME>, then its parameters in the schema's order.
    functions = " | ".join(f"fn{i}" for i in range(len(tools)))
    rules = [f"call: {_CALL_OPEN} ({functions}) {_FUNCTION_CLOSE} {_CALL_CLOSE}"]
    subgrammars = {}
    for i, tool in enumerate(tools):
        head = _literal(f"<function={_name(tool)}>\n")
        if _name(tool) in grammars:  # a custom tool: its input, in its own grammar
            subgrammars[f"g{i}"] = grammars[_name(tool)].as_lark()
            rules.append(f"fn{i}: {head} {_INPUT_OPEN} @g{i} {_PARAMETER_CLOSE}")
            continue
        schema = _parameters(tool)
        required = set(schema.get("required") or ())
        parts = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rule, sub = f"fn{i}_p{j}", sub if isinstance(sub, dict) else {}
            start = _literal(f"<parameter={key}>\n")
            if sub.get("type") == "string" and "enum" in sub:
                choices = " | ".join(_literal(str(v)) for v in sub["enum"])
                rules.append(f"{rule}: {start} ({choices}) {_PARAMETER_CLOSE}")
            elif sub.get("type") == "string":  # text, up to the closing tag its suffix writes
                rules.append(f"{rule}: {start} {rule}_text")
                rules.append(f"{rule}_text[suffix={_PARAMETER_CLOSE}]: /(.|\\n)*/")
            else:  # JSON text, as the template renders numbers, objects and arrays
                rules.append(f"{rule}: {start} {_inline_json(sub)} {_PARAMETER_CLOSE}")
            parts.append(rule if key in required else f"{rule}?")
        rules.append(f"fn{i}: {head} {' '.join(parts)}")
    return "\n".join(rules) + "\n", subgrammars


_CALL_OPEN = _literal(CALL_START + "\n")
_CALL_CLOSE = _literal("\n" + CALL_END)
_FUNCTION_CLOSE = _literal("</function>")
_PARAMETER_CLOSE = _literal("\n</parameter>\n")
_FUNCTION_OPEN = _literal("<function=")
_INPUT_HEAD = _literal(">\n<parameter=input>\n")
_INPUT_OPEN = _literal("<parameter=input>\n")
_INPUT_CLOSE = "\n</parameter>\n</function>\n" + CALL_END
# The call tags inside a regular expression (Lark's /.../: `/` escaped).
_CALL_START_RX = CALL_START.replace("/", "\\/")
_CALL_OPEN_RX = _CALL_START_RX + "\\n"
_CALL_END_RX = CALL_END.replace("/", "\\/")
