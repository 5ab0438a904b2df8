"""Tool calls in model output: which format a chat template uses, and parsing it.

Parsing is mlx-lm's (`mlx_lm.tool_parsers`: one module per format, each
with its call markers and a `parse_tool_call(text, tools)`); this module
finds the calls in streamed text, turns each parse into `ToolCall`s, and
gives a call that does not parse back as ordinary text, never dropped.
The OpenAI, Responses and Anthropic adapters turn `ToolCall`s into their
own shapes.

Format names are mlx-lm's parser modules, except the two whose grammars
specgate also writes for forced calls (gateway/api/structured.py):

- "hermes" (Qwen3, Qwen2.5; mlx-lm's json_tools): a JSON object inside,
  `<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>`
- "qwen3_xml" (Qwen3.5, Qwen3.6, Qwen3-Coder; mlx-lm's qwen3_coder):
  `<tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>`;
  parameter values are text, typed by the tool's JSON schema.

Others (mistral, glm47, kimi_k2, minimax_m2, gemma4, pythonic, ...) are
recognised from the template as mlx-lm recognises them.

A freeform tool (a Responses `custom` tool) takes one text, its parameter
`input`. In the XML format that text is read exactly as the model wrote
it (mlx-lm's parser reads the text "null" as None and ends a value at the
first closing tag), and the call ends at its own closing tags, so an input
that itself says `</tool_call>` is not cut there.

Last, tools as text, for a model whose chat template has no tool support
and whose config opts in (`tool_prompt: default`): see "Tools without a
template" below.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from types import ModuleType

from mlx_lm.tokenizer_utils import _infer_tool_parser  # pinned mlx-lm (uv.lock)

ToolFormat = str
# specgate's names for the formats it also writes grammars for -> mlx-lm's module
_MODULES = {"hermes": "json_tools", "qwen3_xml": "qwen3_coder"}
GRAMMAR_FORMATS: tuple[ToolFormat, ...] = tuple(_MODULES)

CALL_START = "<tool_call>"  # both grammar formats' markers
CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def template_mentions_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` list at all."""
    return template is not None and "tools" in template


class _TemplateOnly:
    """What mlx-lm's format inference reads of a tokenizer, from a template
    alone (llama-server's models have no HF tokenizer here)."""

    def __init__(self, template: str):
        self.chat_template = template

    def get_vocab(self) -> dict:
        return {}


def tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, if one we parse.

    Read from the template's own text: it shows the model the exact format
    it was trained to emit. The XML format's templates also say
    `<tool_call>`, so `<function=` is checked first; then mlx-lm's own
    inference, for the formats of its other parsers.
    """
    if not template_mentions_tools(template):
        return None
    if "<function=" in template and CALL_START in template:
        return "qwen3_xml"
    if CALL_START in template and "<function" not in template:
        return "hermes"
    module = _infer_tool_parser(_TemplateOnly(template))
    return {v: k for k, v in _MODULES.items()}.get(module, module)


def parser(fmt: ToolFormat) -> ModuleType:
    """The mlx-lm parser module of a format."""
    return importlib.import_module(f"mlx_lm.tool_parsers.{_MODULES.get(fmt, fmt)}")


FREEFORM_OPEN = "\n<parameter=input>\n"  # after `<function=NAME>`, a freeform tool's input
FREEFORM_CLOSE = "\n</parameter>\n</function>\n"  # after it, before CALL_END


def parse_call(body: str, fmt: ToolFormat, tools: list[dict] | None = None,
               freeform: frozenset[str] = frozenset()) -> list[ToolCall] | None:  # fmt: skip
    """The calls in one call's body (the text between its markers), or None
    when it does not parse. `tools`: OpenAI-shaped, for the parameter types;
    `freeform`: the tools whose one input is read as written (XML format)."""
    if fmt == "qwen3_xml" and freeform and (call := _freeform_call(body, freeform)):
        return [call]
    try:
        parsed = parser(fmt).parse_tool_call(body, tools)
    except Exception:  # mlx-lm's parsers raise what they meet: it is text
        return None
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        call = _tool_call(item)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _freeform_head(body: str, freeform: frozenset[str]) -> str | None:
    """The freeform tool a call's body opens, if it opens one whole."""
    if not body.startswith("\n<function="):
        return None
    name, sep, _ = body[len("\n<function=") :].partition(">" + FREEFORM_OPEN)
    return name if sep and name in freeform else None


def _freeform_call(body: str, freeform: frozenset[str]) -> ToolCall | None:
    name = _freeform_head(body, freeform)
    if name is None or not body.endswith(FREEFORM_CLOSE):
        return None
    start = len(f"\n<function={name}>{FREEFORM_OPEN}")
    return ToolCall(name, {"input": body[start : len(body) - len(FREEFORM_CLOSE)]})


def _tool_call(item: object) -> ToolCall | None:
    """A parser's {"name": ..., "arguments": ...} as a ToolCall; arguments
    may come as JSON text, or as "parameters"."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(item["name"], args) if isinstance(args, dict) else None


# -- a whole output, streamed or not -------------------------------------------------


@dataclass
class ToolCallStream:
    """Splits streamed model text into text and complete tool calls.

    `feed` returns what can be sent now: strings (text) and `ToolCall`s. Text
    that might be the start of the format's call marker is held back; from
    the marker on, everything is held until its end marker closes the call
    (a format without one, Mistral's, calls to the end of the output).
    Whitespace-only runs next to tool calls are dropped (the newlines models
    put between calls are syntax, not content); elsewhere whitespace is
    kept. The output does not depend on how the text is cut into pieces.
    """

    fmt: ToolFormat
    tools: list[dict] = field(default_factory=list)  # OpenAI-shaped: parameter types
    freeform: frozenset[str] = frozenset()  # tools whose one input is text (parse_call)
    calls: int = 0  # complete calls parsed so far
    _buf: str = ""
    _inside: bool = False
    _pending_ws: str = ""  # whitespace held until we know what follows it
    _ws_before_call: str = ""  # given back if the call turns out malformed

    def __post_init__(self) -> None:
        module = parser(self.fmt)
        self._start, self._end = module.tool_call_start, module.tool_call_end

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._buf += text
        while True:
            if self._inside:
                end = self._call_end()
                if end is None:
                    return out
                raw = self._buf[: end + len(self._end)]
                self._buf, self._inside = self._buf[end + len(self._end) :], False
                self._call(raw, raw[len(self._start) : end], out)
                continue
            start = self._buf.find(self._start)
            if start >= 0:
                self._text(self._buf[:start], out, last=False)
                self._ws_before_call, self._pending_ws = self._pending_ws, ""
                self._buf, self._inside = self._buf[start:], True
                continue
            keep = _partial_suffix(self._buf, self._start)
            self._text(self._buf[: len(self._buf) - keep], out, last=False)
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def _call_end(self) -> int | None:
        """Where the open call's end marker starts in the buffer, once seen.
        A freeform tool's call ends at its input's closing tags and the end
        marker together (its input may say the marker alone)."""
        if not self._end:
            return None
        end = self._buf.find(self._end)
        if end < 0:
            return None
        if self.fmt != "qwen3_xml" or not self.freeform:
            return end
        # The end marker is in the buffer, so a freeform tool's head, which
        # comes before it, is there whole if the call opens one.
        if _freeform_head(self._buf[len(self._start) :], self.freeform) is None:
            return end
        end = self._buf.find(FREEFORM_CLOSE + self._end, len(self._start))
        return None if end < 0 else end + len(FREEFORM_CLOSE)

    def finish(self) -> list[str | ToolCall]:
        """The end of the output: a call without an end marker ends here;
        whatever else is held is text (an unclosed call too)."""
        out: list[str | ToolCall] = []
        if self._inside and not self._end:
            raw, self._buf, self._inside = self._buf, "", False
            self._call(raw, raw[len(self._start) :], out)
        rest = (self._ws_before_call if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        self._text(rest, out, last=True)
        return out

    def _call(self, raw: str, body: str, out: list) -> None:
        calls = parse_call(body, self.fmt, self.tools, self.freeform)
        if calls is None:  # malformed: it is text, with the whitespace before it
            self._text(self._ws_before_call + raw, out, last=False)
            return
        self.calls += len(calls)
        self._pending_ws = ""
        out.extend(calls)

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


def split_output(text: str, fmt: ToolFormat, tools: list[dict] | None = None
                 ) -> tuple[str, list[ToolCall]]:  # fmt: skip
    """A complete output as (text, tool calls), exactly as streaming gives them."""
    stream = ToolCallStream(fmt, tools or [])
    events = stream.feed(text) + stream.finish()
    return (
        "".join(e for e in events if isinstance(e, str)),
        [e for e in events if isinstance(e, ToolCall)],
    )


# -- tools without a template: the tool-use prompt ----------------------------------
#
# For a model whose chat template has no tool support, where the model
# opts in (`tool_prompt: default` in its config entry).
#
# The template cannot render tools, so the conversation it gets is plain
# text that says them, in the JSON call syntax of the "hermes" format,
# which this module already parses and structured.py writes grammars for:
#
# - the tools and how to call them: `SYSTEM_PROMPT`, with the tools' JSON
#   schemas, merged into the system message (after the client's own), or,
#   for a template that renders no system turn, before the first user
#   message's text;
# - an earlier assistant turn's calls: its text, then one
#   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` per call,
#   exactly as a call is written now (the grammar's JSON layout);
# - tool results (OpenAI's `tool` messages, Anthropic's `tool_result`
#   blocks and Responses' `function_call_output` items, which every adapter
#   hands over as `tool` messages): a user turn of `<tool_response>` blocks,
#   in the order they came, with the user's own text after them where the
#   same turn has some. Templates without tools seldom know a `tool` role,
#   and some refuse roles they do not know, or two user turns in a row.
#
# The prompt is written here (not taken from a model family's template):
# it names the syntax, where calls go (at the end of the reply) and where
# results come back, in as few words as a small model can follow.
PROMPT_TOOL_FORMAT: ToolFormat = "hermes"  # the call syntax the prompt teaches
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"

SYSTEM_PROMPT = """\
# Tools

You can call the functions below to help with the request. Each is described by its JSON schema:
<tools>
{tools}
</tools>

To call a function, write one block per call, each holding a JSON object with the function's \
name and its arguments (which follow the function's parameters schema):
<tool_call>
{{"name": "<function name>", "arguments": {{"<parameter>": <value>}}}}
</tool_call>
Calls come at the end of your reply: write nothing after them. The results come back to you \
in <tool_response></tool_response> blocks, in the order of the calls. When no function is \
needed, answer in plain text."""


def tool_use_prompt(tools: list[dict]) -> str:
    """The tool-use prompt for these tools (OpenAI-shaped), one JSON line each."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return SYSTEM_PROMPT.format(tools=lines)


def call_text(name: str, arguments: dict | str) -> str:
    """One call, as the model writes it (the grammar's JSON layout: ", " and
    ": " separators, nothing else between tokens)."""
    if isinstance(arguments, str):  # a client may send them as JSON text
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            pass  # shown as the string it is
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def tools_as_text(messages: list[dict], tools: list[dict], *, system_turn: bool = True) -> list[dict]:
    """Template messages with calls, results and (when `tools` is not empty)
    the tool-use prompt as text. `system_turn`: the template renders a
    system message; else the prompt goes before the first user text."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"].get("arguments") or {})
                     for c in m["tool_calls"]]  # fmt: skip
            text = _text(m.get("content"))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = "\n".join(([text] if text else []) + calls)
        elif role == "tool":
            block = f"{RESPONSE_START}\n{_text(m.get('content'))}\n{RESPONSE_END}"
            if out and out[-1].get("_results"):  # the same turn's results: one user turn
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "_results": True}
        elif role == "user" and out and out[-1].get("_results"):
            # The user's text in the turn that carried the results (Anthropic).
            out[-1]["content"] += "\n" + _text(m.get("content"))
            out[-1]["_results"] = False
            continue
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if not tools:
        return out
    prompt = tool_use_prompt(tools)
    if system_turn:
        if out and out[0].get("role") == "system":
            own = _text(out[0].get("content"))
            return [out[0] | {"content": f"{own}\n\n{prompt}" if own else prompt}] + out[1:]
        return [{"role": "system", "content": prompt}] + out
    for i, m in enumerate(out):
        if m.get("role") == "user":
            own = _text(m.get("content"))
            return out[:i] + [m | {"content": f"{prompt}\n\n{own}" if own else prompt}] + out[i + 1 :]
    return [{"role": "user", "content": prompt}] + out


def _text(content) -> str:
    """A message's content as text (a list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
