"""Schemathesis hooks for tests/test_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

specgate's OpenAPI schema says `model` is a string; almost every random
string names no model, so a fuzzer would only ever meet the 404 path. The
test tells schemathesis which models the server under test serves, so
generated requests reach planning, sampling and the engines.
"""

from __future__ import annotations

import os

import schemathesis


def _served() -> list[str]:
    return [m for m in os.environ.get("SPECGATE_FUZZ_MODELS", "").split(",") if m]


def _pin_models(node, models: list[str]) -> None:
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and isinstance(props.get("model"), dict):
            props["model"] = {"type": "string", "enum": models}
        if node.get("name") == "model_id" and node.get("in") == "path":
            node["schema"] = {"type": "string", "enum": models}
        for value in node.values():
            _pin_models(value, models)
    elif isinstance(node, list):
        for value in node:
            _pin_models(value, models)


@schemathesis.hook
def before_load_schema(context, raw_schema):
    if models := _served():
        _pin_models(raw_schema, models)
