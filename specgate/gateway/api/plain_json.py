"""What a request's decoded JSON may hold: Unicode text, in keys as in
values, nested at most MAX_DEPTH levels. Checked once per body before its
fields are read (each API's body model calls `refuse_unsafe_json`), and on
the JSON text a body carries inside a string (a tool call's `arguments`),
so that nothing past the parse meets what it would fail on deep inside:
a lone UTF-16 surrogate (JSON's "\\ud800" escape allows one) breaks a
tokenizer, a UTF-8 encoder or a JSON answer that echoes it; deep nesting
overflows every recursive reader (json.dumps, a chat template, Python's
own recursion limit). Either is the client's error, a 400 naming where.

The walk is iterative, so a body nested as deep as json.loads allows
(about 1,000 levels) cannot overflow it; one nested deeper fails to parse
at all (gateway/errors.py answers that 400).
"""

from __future__ import annotations

import json
from typing import Any

# Containers inside containers, the body itself counting as one. A chat
# body's own structure takes about 6 (body, messages, a message, its
# blocks, a block, a tool call's input); a tool's JSON schema takes 2 per
# level of nested object (properties, then the property).
MAX_DEPTH = 64
_SHOWN_STEPS = 8  # of a path too deep to print whole


def _text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(steps: tuple, root: str) -> str:
    shown = ".".join(str(s) for s in steps[:_SHOWN_STEPS])
    if len(steps) > _SHOWN_STEPS:
        shown += "..."
    return f"{root}.{shown}" if root and shown else root or shown or "body"


def problem(data: Any, root: str = "") -> str | None:
    """What is wrong with decoded JSON, naming where (`root` names the
    value itself, as in "arguments"), or None."""
    # (value, its path as a tuple of steps, its depth)
    pending: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while pending:
        value, steps, depth = pending.pop()
        if isinstance(value, str):
            if not _text(value):
                return (f"{_path(steps, root)}: contains a lone UTF-16 surrogate, which is "
                        "not valid Unicode")  # fmt: skip
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            return f"{_path(steps, root)}: nested more than {MAX_DEPTH} levels deep"
        if isinstance(value, list):
            entries = list(enumerate(value))
        else:
            for key in value:  # JSON's keys are strings
                if not _text(key):
                    return (f"{_path(steps, root)}: the key {ascii(key)} contains a lone UTF-16 "
                            "surrogate, which is not valid Unicode")  # fmt: skip
            entries = list(value.items())
        # Reversed, so the first problem in the document's order is found first.
        pending.extend((item, (*steps, key), depth + 1) for key, item in reversed(entries))
    return None


def refuse_unsafe_json(data: Any) -> Any:
    """A body model's before-validator: the body, or a ValueError saying where it is bad."""
    if (found := problem(data)) is not None:
        raise ValueError(found)
    return data


def json_object_text(text: str) -> dict:
    """JSON text of an object (a tool call's arguments, as OpenAI sends
    them; empty is {}), checked as a body is; else a ValueError."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        value = None
    except RecursionError:  # deeper than json.loads reaches
        raise ValueError(f"arguments: nested more than {MAX_DEPTH} levels deep") from None
    if not isinstance(value, dict):
        raise ValueError("arguments must be JSON text of an object")
    if (found := problem(value, "arguments")) is not None:
        raise ValueError(found)
    return value
