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


def _path(at: tuple | None, root: str) -> str:
    """A path kept as nested (parent, step) pairs, as text."""
    steps = []
    while at is not None:
        at, step = at
        steps.append(str(step))
    steps.reverse()
    shown = ".".join(steps[:_SHOWN_STEPS]) + ("..." if len(steps) > _SHOWN_STEPS else "")
    return f"{root}.{shown}" if root and shown else root or shown or "body"


def _surrogate(at: tuple | None, root: str) -> str:
    return f"{_path(at, root)}: contains a lone UTF-16 surrogate, which is not valid Unicode"


def problem(data: Any, root: str = "") -> str | None:
    """What is wrong with decoded JSON, naming where (`root` names the
    value itself, as in "arguments"), or None."""
    if isinstance(data, str):
        return None if _text(data) else _surrogate(None, root)
    # Containers still to look into: (container, its path, its depth).
    pending: list[tuple[dict | list, tuple | None, int]] = []
    if isinstance(data, (dict, list)):
        pending.append((data, None, 1))
    while pending:
        value, at, depth = pending.pop()
        if depth > MAX_DEPTH:
            return f"{_path(at, root)}: nested more than {MAX_DEPTH} levels deep"
        if isinstance(value, dict):
            for key in value:  # JSON's keys are strings
                if not _text(key):
                    return (f"{_path(at, root)}: the key {ascii(key)} contains a lone UTF-16 "
                            "surrogate, which is not valid Unicode")  # fmt: skip
            entries = value.items()
        else:
            entries = enumerate(value)
        for key, item in entries:
            if isinstance(item, str):
                if not _text(item):
                    return _surrogate((at, key), root)
            elif isinstance(item, (dict, list)):
                pending.append((item, (at, key), depth + 1))
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
