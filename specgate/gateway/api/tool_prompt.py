"""Tools for a model whose chat template has no tool support, as a model
opts in (`tool_prompt: default` in its config entry).

The template cannot render tools, so the conversation it gets is plain
text that says them, in the JSON call syntax of gateway/api/tools.py's
"hermes" format, which specgate already parses and writes grammars for
(gateway/api/structured.py):

- the tools and how to call them: `SYSTEM_PROMPT`, with the tools' JSON
  schemas, merged into the system message (after the client's own), or,
  for a template that renders no system turn, before the first user
  message's text;
- an earlier assistant turn's calls: its text, then one
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call,
  exactly as a call is written now (the grammar's JSON layout);
- tool results (OpenAI's `tool` messages, Anthropic's `tool_result`
  blocks and Responses' `function_call_output` items, which every adapter
  hands over as `tool` messages): a user turn of `<tool_response>` blocks,
  in the order they came, with the user's own text after them where the
  same turn has some. Templates without tools seldom know a `tool` role,
  and some refuse roles they do not know, or two user turns in a row.

The prompt is written here (not taken from a model family's template):
it names the syntax, where calls go (at the end of the reply) and where
results come back, in as few words as a small model can follow.
"""

from __future__ import annotations

import json

from specgate.gateway.api.tools import CALL_END, CALL_START

TOOL_FORMAT = "hermes"  # the call syntax: tools.py's name for it
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


def system_prompt(tools: list[dict]) -> str:
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


def as_text(messages: list[dict], tools: list[dict], *, system_turn: bool = True) -> list[dict]:
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
    prompt = system_prompt(tools)
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
