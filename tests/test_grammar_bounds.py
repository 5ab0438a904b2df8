"""The schema bounds (engines/grammar/bounds.py) and the grammar sandbox
(engines/grammar/sandbox.py), directly. Through a real server:
tests/test_hostile_schemas.py and tests/test_fuzz_hostile.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specgate.engines.grammar.bounds import check_schema
from specgate.engines.grammar.matcher import GrammarError, TokenizerSpec, json_constraint
from specgate.engines.grammar.sandbox import GrammarSandbox

DEMO_TOKENIZER = Path(__file__).parents[1] / "specgate/engines/checkpoints/demo/tokenizer.json"


def chain(n: int, via: str) -> dict:
    def link(i):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"type": "object", "properties": {"x": ref}} if via == "property" else ref

    defs = {f"d{i}": link(i) for i in range(n)} | {f"d{n}": {"type": "string"}}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_list(n: int) -> list:
    value: list = []
    for _ in range(n):
        value = [value]
    return value


OK = {
    "plain": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    "tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    },  # fmt: skip
    "root-recursion": {"type": "object", "properties": {"next": {"$ref": "#"}}},
    "shared-def": {
        "$defs": {"s": {"type": "string"}},
        "anyOf": [{"$ref": "#/$defs/s"}, {"type": "array", "items": {"$ref": "#/$defs/s"}}],
    },  # fmt: skip
    "escaped-pointer": {"$defs": {"a/b": {"type": "integer"}}, "$ref": "#/$defs/a~1b"},
    "30-deep": chain(30, "property"),
    "1000-required": {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(1000)},
        "required": [f"p{i}" for i in range(1000)],
    },  # fmt: skip
}
REFUSED = {
    "self-loop": ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "endless loop"),
    "loop-through-allOf": (
        {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
        "endless loop",
    ),  # fmt: skip
    "ref-chain": (chain(900, "ref"), "nests deeper than 128"),
    "property-chain": (chain(999, "property"), "nests deeper than 128"),
    "wide-list": ({"enum": list(range(1001))}, "1001 entries"),
    "wide-defs": ({"$defs": {f"d{i}": {"type": "string"} for i in range(1001)}}, "1001 entries"),
    "optional": (
        {"type": "object", "properties": {f"p{i}": {} for i in range(401)}},
        "401 optional",
    ),
    "total": (
        {
            "type": "object",
            "properties": {
                f"o{j}": {
                    "type": "object",
                    "properties": {f"p{i}": {} for i in range(1000)},
                    "required": [f"p{i}" for i in range(1000)],
                }
                for j in range(6)
            },
            "required": [f"o{j}" for j in range(6)],
        },
        "5000 properties",
    ),  # fmt: skip
    "remote": ({"$ref": "https://example.com/s.json"}, "nothing is fetched"),
    "dangling": ({"$ref": "#/$defs/nope"}, "does not resolve"),
    "deep-const": ({"const": nested_list(200)}, "a value nests deeper"),
}


@pytest.mark.parametrize("name", list(OK))
def test_what_a_real_schema_does_passes(name):
    check_schema(OK[name], "response_format")


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_breaks_a_bound_is_refused_naming_where(name):
    schema, words = REFUSED[name]
    with pytest.raises(GrammarError, match=r"^response_format: ") as e:
        check_schema(schema, "response_format")
    assert words in str(e.value) and "(at '" in str(e.value)


def test_a_deep_schema_is_walked_without_recursion():
    s: dict = {"type": "string"}
    for _ in range(20_000):  # far past Python's recursion limit
        s = {"type": "array", "items": s}
    with pytest.raises(GrammarError, match="nests deeper"):
        check_schema(s, "p")


# -- the sandbox ----------------------------------------------------------------------


def spec() -> TokenizerSpec:
    return TokenizerSpec("demo", DEMO_TOKENIZER.read_text(), 4096, (0,))


async def outcomes(sandbox: GrammarSandbox, *schemas) -> list[str | None]:
    out = []
    try:
        for schema in schemas:
            c = json_constraint(schema, "response_format")
            try:
                await sandbox.check(c.grammar, c.param, spec())
                out.append(None)
            except GrammarError as e:
                out.append(str(e))
    finally:
        await sandbox.close()
    return out


def test_the_sandbox_compiles_with_the_tokenizer_and_reports_the_first_line():
    ok, bad = asyncio.run(outcomes(GrammarSandbox(), OK["tree"], {"type": "no-such-type"}))
    assert ok is None
    assert bad.startswith("response_format: ") and "\n" not in bad


def test_a_child_that_dies_is_a_400_and_the_next_job_gets_a_new_child():
    """Failure injection: an address-space cap too small for the child to
    start stands for a compile that kills it."""
    sandbox = GrammarSandbox(memory_bytes=64 << 20)

    async def run():
        c = json_constraint(OK["plain"], "response_format")
        with pytest.raises(GrammarError, match="compiler failed on this schema"):
            await sandbox.check(c.grammar, c.param, spec())
        sandbox.memory_bytes = 4 << 30
        await sandbox.check(c.grammar, c.param, spec())
        await sandbox.close()

    asyncio.run(run())
    assert sandbox.outcomes["crashed"] == 1 and sandbox.outcomes["ok"] == 1


def test_a_compile_past_the_budget_is_a_400():
    sandbox = GrammarSandbox(timeout_s=0.001)
    (error,) = asyncio.run(outcomes(sandbox, OK["plain"]))
    assert "did not compile within" in error and sandbox.outcomes["timed_out"] == 1
