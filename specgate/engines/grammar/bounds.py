"""Bounds on a JSON schema before any of it reaches the grammar compiler.

llguidance compiles a schema by recursion along its nesting, `$ref`s
followed: a chain of a thousand refs overflows the C stack and kills the
process, and wide or huge schemas take seconds to compile (10,000 optional
properties: 6 s), on whichever thread compiles them. So every schema a
request brings is walked here first, iteratively (a hostile depth cannot
overflow this walk), and refused with a message naming where it breaks a
bound. What passes is still compiled in a child process first
(sandbox.py): the bounds keep the engine's own compile cheap and shallow,
the child keeps an unknown crash away from the gateway.

The bounds are OpenAI's published ones for structured outputs, loosened
(5,000 properties in all; 10 levels of objects; 1,000 enum values), and kept under
llguidance's own 2,000 alternatives per rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from specgate.engines.grammar.matcher import GrammarError


@dataclass(frozen=True)
class SchemaLimits:
    depth: int = 128  # objects and lists inside each other, `$ref`s followed (an object
    # with properties is two: itself and its `properties`)
    width: int = 1_000  # keys of one object, items of one list (properties, enum, anyOf)
    properties: int = 5_000  # property schemas in all
    # Optional properties of one object: llguidance tracks about four
    # parser items per optional property still possible, and stops a
    # generation past 2,000 items per row (500 optional: "2,007 items").
    optional: int = 400
    nodes: int = 50_000  # JSON values in all, each `$ref` target counted once


LIMITS = SchemaLimits()

# Keywords whose subschemas describe a part of the value (a property, an
# item): a `$ref` cycle through one of them is a recursive type (a tree);
# one through only combinators (`$ref`, allOf, anyOf, ...) never produces
# anything and is refused.
_CONSUMING = frozenset({
    "properties", "patternProperties", "additionalProperties", "items", "prefixItems",
    "additionalItems", "contains", "unevaluatedItems", "unevaluatedProperties",
})  # fmt: skip
_NOT_SCHEMAS = frozenset(
    {"enum", "const", "default", "examples", "required"}
)  # data, not subschemas


def check_schema(schema: object, param: str, limits: SchemaLimits = LIMITS) -> None:
    """Raise GrammarError, naming `param` and a JSON pointer, where `schema`
    breaks a bound or has a `$ref` that does not resolve or loops."""
    _Walk(schema, param, limits).run()


class _Walk:
    def __init__(self, root: object, param: str, limits: SchemaLimits):
        self.root, self.param, self.limits = root, param, limits
        self.nodes = self.properties = 0

    def fail(self, message: str, pointer: str) -> None:
        where = pointer if len(pointer) <= 120 else "…" + pointer[-119:]
        raise GrammarError(f"{self.param}: {message} (at '{where or '/'}')")

    def run(self) -> None:
        # Post-order, with an explicit stack: a container's height (levels
        # below it, `$ref`s followed) is known once its children's are;
        # each container is walked once, a ref target included. `path`
        # holds the keys the containers on the way down were entered by, so
        # a `$ref` back to one of them is a cycle, and whether a part of the
        # value lies on it can be read off.
        height: dict[int, int] = {}
        path: list[str] = []
        on_path: dict[int, int] = {}
        stack: list[tuple[object, str, str, bool]] = [(self.root, "", "", False)]
        while stack:
            value, pointer, entered_by, leaving = stack.pop()
            if not isinstance(value, dict | list):
                self._count(pointer)
                continue
            if leaving:
                children = self._children(value, pointer, count=False)
                below = [height.get(id(c), 0) for c, _, _ in children if isinstance(c, dict | list)]
                height[id(value)] = 1 + max(below, default=0)
                if height[id(value)] > self.limits.depth:
                    self.fail(f"the schema nests deeper than {self.limits.depth} levels "
                              "(`$ref`s followed)", pointer)  # fmt: skip
                del on_path[id(value)]
                path.pop()
                continue
            if id(value) in height or id(value) in on_path:
                continue  # walked already, or a cycle (checked at its `$ref`)
            self._count(pointer)
            if len(value) > self.limits.width:
                kind = "object" if isinstance(value, dict) else "list"
                self.fail(f"{len(value)} entries in one {kind}, more than {self.limits.width}",
                          pointer)  # fmt: skip
            if isinstance(value, dict) and isinstance(value.get("properties"), dict):
                names = value["properties"]
                self.properties += len(names)
                if self.properties > self.limits.properties:
                    self.fail(f"more than {self.limits.properties} properties in all", pointer)
                required = value.get("required")
                required = set(required) if isinstance(required, list) and all(
                    isinstance(r, str) for r in required) else set()  # fmt: skip
                optional = len(names) - len(required.intersection(names))
                if optional > self.limits.optional:
                    self.fail(f"{optional} optional properties in one object, more than "
                              f"{self.limits.optional} (list them in `required`, or split the "
                              "object)", pointer)  # fmt: skip
            on_path[id(value)] = len(path)
            path.append(entered_by)
            stack.append((value, pointer, entered_by, True))
            for child, here, key in self._children(value, pointer, count=True):
                if key == "$ref" and id(child) in on_path:
                    if not _CONSUMING.intersection(path[on_path[id(child)] + 1 :]):
                        self.fail(f"`$ref` '{value['$ref'][:80]}' refers back to itself without "
                                  "describing any part of the value (an endless loop)", here)  # fmt: skip
                    continue
                stack.append((child, here, key, False))

    def _children(self, value: dict | list, pointer: str, count: bool):
        """(subschema, its pointer, the key it is entered by); a list's
        items are entered by the key the list was. count: count the data
        (enum, const, ...) it holds, once, on the way down."""
        if isinstance(value, list):
            return [(item, f"{pointer}/{i}", "") for i, item in enumerate(value)]  # fmt: skip
        out = []
        for key, sub in value.items():
            here = f"{pointer}/{_escape(str(key))}"
            if key == "$ref":  # the target, at its own place in the document
                out.append((self._resolve(sub, here), unquote(str(sub)[1:]), key))
            elif key in _NOT_SCHEMAS:
                if count:
                    self._count_data(sub, here)
            else:
                out.append((sub, here, key))
        return out

    def _resolve(self, ref: object, pointer: str) -> object:
        if not isinstance(ref, str):
            self.fail("`$ref` is not a string", pointer)
        if not ref.startswith("#"):
            self.fail(f"`$ref` '{ref[:80]}' is not within the schema (only '#...' refs are "
                      "followed, nothing is fetched)", pointer)  # fmt: skip
        at = self.root
        for part in unquote(ref[1:]).split("/")[1:] if ref[1:] else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(at, dict) and part in at:
                at = at[part]
            elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
                at = at[int(part)]
            else:
                self.fail(f"`$ref` '{ref[:80]}' does not resolve", pointer)
        return at

    def _count(self, pointer: str) -> None:
        self.nodes += 1
        if self.nodes > self.limits.nodes:
            self.fail(f"the schema has more than {self.limits.nodes} values", pointer)

    def _count_data(self, value: object, pointer: str) -> None:
        """An enum's or a const's values, walked iteratively too: a deep
        const is as hostile as a deep schema."""
        stack = [(value, 1)]
        while stack:
            value, depth = stack.pop()
            self._count(pointer)
            if isinstance(value, dict | list):
                if depth > self.limits.depth:
                    self.fail(f"a value nests deeper than {self.limits.depth} levels", pointer)
                if len(value) > self.limits.width:
                    self.fail(f"{len(value)} entries in one list or object, more than "
                              f"{self.limits.width}", pointer)  # fmt: skip
                stack.extend(
                    (v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)
                )


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
