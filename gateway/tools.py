"""Tool calls in model output: which format a chat template uses, and parsing it.

Plain functions and one small streaming parser, API-neutral: the OpenAI and
Anthropic adapters turn the `ToolCall`s into their own shapes.

Supported formats, both wrapped in `<tool_call>` ... `</tool_call>`:

- "hermes" (Qwen3, Qwen2.5): a JSON object inside,
  `<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>`
- "qwen3_xml" (Qwen3.5, Qwen3.6, Qwen3-Coder): XML-ish tags inside,
  `<tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>`;
  parameter values are text, typed by the tool's JSON schema.

A call that does not parse is given back as ordinary text, never dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

ToolFormat = Literal["hermes", "qwen3_xml"]
FORMATS: tuple[ToolFormat, ...] = ("hermes", "qwen3_xml")

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def template_mentions_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` list at all."""
    return template is not None and "tools" in template


def tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, if one we parse.

    Read from the template's own text: it shows the model the exact format it
    was trained to emit. The XML format's templates also say `<tool_call>`, so
    `<function=` is checked first.
    """
    if not template_mentions_tools(template):
        return None
    if "<function=" in template:
        return "qwen3_xml"
    if CALL_START in template:
        return "hermes"
    return None


def parameter_types(tools: list[dict]) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} from OpenAI-shaped tools."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        types[fn.get("name", "")] = {
            p: s.get("type", "") if isinstance(s, dict) and isinstance(s.get("type"), str) else ""
            for p, s in props.items()
        }
    return types


# -- one call's body (the text between the tags) --------------------------------


def parse_hermes(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}`; arguments may also be a JSON string."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_xml(body: str, types: dict[str, dict[str, str]] | None = None) -> ToolCall | None:
    """`<function=NAME>` with `<parameter=P>VALUE</parameter>` children.

    Values are text; a parameter whose schema type is not "string" is read as
    JSON when it parses (numbers, booleans, objects, arrays), as the template
    wrote them. Anything between parameters but whitespace makes the call
    malformed.
    """
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    schema = (types or {}).get(name, {})
    args: dict = {}
    end = 0
    for p in _PARAMETER.finditer(inner):
        if inner[end : p.start()].strip():
            return None
        end = p.end()
        key, value = p.group(1).strip(), _strip_one_newline(p.group(2))
        args[key] = _typed(value, schema.get(key, "string"))
    if inner[end:].strip() or not name:
        return None
    return ToolCall(name, args)


def _strip_one_newline(value: str) -> str:
    # The format puts the value on its own line: one newline each side is syntax.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed(value: str, kind: str):
    if kind in ("string", ""):
        return value
    if kind == "boolean" and value.strip() in ("True", "False"):
        return value.strip() == "True"  # a Jinja template renders Python's spelling
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def parse_call(body: str, fmt: ToolFormat, types: dict[str, dict[str, str]] | None = None):
    """One call's body in `fmt`, or None when it is malformed."""
    if fmt == "hermes":
        return parse_hermes(body)
    return parse_qwen3_xml(body, types)


# -- a whole output, streamed or not -------------------------------------------------


@dataclass
class ToolCallStream:
    """Splits streamed model text into text and complete tool calls.

    `feed` returns what can be sent now: strings (text) and `ToolCall`s. Text
    that might be the start of `<tool_call>` is held back; from `<tool_call>`
    on, everything is held until `</tool_call>` closes it. Whitespace-only
    runs next to tool calls are dropped (the newlines models put between
    calls are syntax, not content); elsewhere whitespace is kept. The output
    does not depend on how the text is cut into pieces.
    """

    fmt: ToolFormat
    types: dict[str, dict[str, str]] = field(default_factory=dict)
    calls: int = 0  # complete calls parsed so far
    _buf: str = ""
    _inside: bool = False
    _pending_ws: str = ""  # whitespace held until we know what follows it
    _ws_before_call: str = ""  # given back if the call turns out malformed

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._buf += text
        while True:
            if self._inside:
                end = self._buf.find(CALL_END)
                if end < 0:
                    return out
                raw = self._buf[: end + len(CALL_END)]
                self._buf, self._inside = self._buf[end + len(CALL_END) :], False
                call = parse_call(raw[len(CALL_START) : end], self.fmt, self.types)
                if call is None:  # malformed: it is text, with the whitespace before it
                    self._text(self._ws_before_call + raw, out, last=False)
                else:
                    self.calls += 1
                    self._pending_ws = ""
                    out.append(call)
                continue
            start = self._buf.find(CALL_START)
            if start >= 0:
                self._text(self._buf[:start], out, last=False)
                self._ws_before_call, self._pending_ws = self._pending_ws, ""
                self._buf, self._inside = self._buf[start:], True
                continue
            keep = _partial_suffix(self._buf, CALL_START)
            self._text(self._buf[: len(self._buf) - keep], out, last=False)
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self) -> list[str | ToolCall]:
        """The end of the output: whatever is held is text (an unclosed call too)."""
        out: list[str | ToolCall] = []
        rest = (self._ws_before_call if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        self._text(rest, out, last=True)
        return out

    def _text(self, text: str, out: list, last: bool) -> None:
        text = self._pending_ws + text
        self._pending_ws = ""
        if last:
            if text and not (self.calls and not text.strip()):
                out.append(text)
            return
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        if body:
            out.append(body)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_output(
    text: str, fmt: ToolFormat, types: dict[str, dict[str, str]] | None = None
) -> tuple[str, list[ToolCall]]:
    """A complete output as (text, tool calls), exactly as streaming gives them."""
    stream = ToolCallStream(fmt, types or {})
    events = stream.feed(text) + stream.finish()
    return (
        "".join(e for e in events if isinstance(e, str)),
        [e for e in events if isinstance(e, ToolCall)],
    )
