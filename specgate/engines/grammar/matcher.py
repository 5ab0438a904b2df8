"""Constrained decoding: the tokens a grammar allows next, per sequence.

A request's `OutputConstraint` (engines/base.py) carries a grammar in
llguidance's format (a JSON schema or a Lark grammar, built below and
compiled in the sandbox first: sandbox.py). llguidance rather than
xgrammar: one abi3 wheel with no dependencies (xgrammar pulls in torch),
masks computed on the CPU in tens of microseconds, and a matcher that
validates, consumes and rolls back tokens, which is what speculative
decoding needs: a verify position's mask is the one the grammar reaches
after the drafts before it, and a rejected draft rolls back.

`Grammars` is one model's: the tokenizer llguidance needs, built once.
`GrammarState` is one sequence's; the engines apply its masks to the
penalised logits (`masked`), before temperature and truncation, so the
target's p and a drafter's q see the same mask.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from specgate.engines.base import EngineError, OutputConstraint

if TYPE_CHECKING:
    import llguidance


def _llguidance() -> ModuleType:
    """llguidance, imported where a grammar is built or followed: every
    engine imports this module, and a process that never constrains output
    (a bench, a machine that carries only what it runs) need not load the
    native library."""
    import llguidance

    return llguidance

NEG_INF = float("-inf")

# Separators fixed to one space and no free whitespace elsewhere: a
# flexible-whitespace grammar lets a small model emit newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class TokenizerSpec:
    """A model's tokenizer as llguidance builds it (LLTokenizer's arguments)."""

    key: str
    json: str = field(repr=False)
    n_vocab: int
    eos: tuple[int, ...]


class GrammarError(EngineError):
    """A grammar that cannot be compiled, or a sequence it cannot follow
    (the gateway checks grammars before a request runs: while it runs,
    this is the engine failing that request)."""


def json_constraint(schema: dict | None, param: str) -> OutputConstraint:
    """Output that is one JSON value matching `schema` (None: any JSON
    object). Not compiled here: bounds.py, then sandbox.py, check it before
    an engine compiles it."""
    body = {"type": "object"} if schema is None else schema
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(body, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:  # llguidance reports a bad schema as ValueError
        raise GrammarError(f"{param}: {first_line(str(e))}") from None
    return OutputConstraint(grammar, json.dumps(body), param)


def lark_constraint(lark: str, param: str, grammars: dict[str, str] | None = None
                    ) -> OutputConstraint:  # fmt: skip
    """Output that matches a Lark grammar (llguidance's dialect: `%json{...}`
    embeds a JSON schema, special tokens are written bare, `<|im_end|>`).
    `grammars`: Lark grammars of their own, by name, that `lark` refers to
    as `@name` (each with its own rules and `start`, so a client's grammar
    embeds whole). Not compiled here, as above."""
    if not grammars:
        return OutputConstraint(_llguidance().LLMatcher.grammar_from_lark(lark), None, param)
    parts = [{"lark_grammar": lark}] + [{"name": n, "lark_grammar": g} for n, g in grammars.items()]
    return OutputConstraint(json.dumps({"grammars": parts}), None, param)


def regex_as_lark(regex: str) -> str:
    """A regular expression (Rust `regex` syntax, llguidance's) as a Lark
    grammar of its own, escaped as llguidance escapes it."""
    return json.loads(_llguidance().LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]


def first_line(error: str, limit: int = 300) -> str:
    """llguidance's message without the parser state it dumps after it."""
    line = error.strip().splitlines()[0] if error.strip() else "the grammar is invalid"
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Grammars:
    """One model's grammar support: its tokenizer as llguidance sees it
    (built on first use: a large vocabulary takes a moment)."""

    def __init__(self, tokenizer, vocab_size: int, key: str):
        self._tokenizer = tokenizer  # mlx-lm's TokenizerWrapper
        self.vocab_size = vocab_size
        self.key = key  # names this tokenizer in the sandbox's children
        self._spec: TokenizerSpec | None = None
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def spec(self) -> TokenizerSpec:
        """The tokenizer as llguidance rebuilds it (here, and in the
        sandbox's children): tokenizer.json's text, as llguidance.hf reads
        it from a fast tokenizer, with padding and truncation off."""
        with self._lock:
            if self._spec is None:
                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                eos = sorted(getattr(self._tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
                backend = getattr(hf, "backend_tokenizer", None)
                if backend is None:
                    raise GrammarError("this model's tokenizer cannot drive constrained decoding: "
                                       "it is not a fast (`tokenizers`) tokenizer")  # fmt: skip
                backend = copy.copy(backend)
                backend.no_padding()
                backend.no_truncation()
                self._spec = TokenizerSpec(self.key, backend.to_str(), self.vocab_size, tuple(eos))
            return self._spec

    def _llg(self) -> llguidance.LLTokenizer:
        spec = self.spec()
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = _llguidance().LLTokenizer(spec.json, n_vocab=spec.n_vocab,
                                                        eos_token=list(spec.eos))  # fmt: skip
                except Exception as e:
                    raise GrammarError(f"this model's tokenizer cannot drive constrained "
                                       f"decoding: {first_line(str(e))}") from None  # fmt: skip
            return self._ll

    def state(self, constraint: OutputConstraint | None) -> GrammarState | None:
        return None if constraint is None else GrammarState(self._llg(), constraint)


class GrammarState:
    """Where one sequence stands in its grammar.

    Committed tokens go through `advance`. A proposer drafting token by token
    pushes its drafts with `draft` (each draw masked by the state the drafts
    before it reached); the decoder takes them back with `undo_drafts`.

    An EOS among drafts is never consumed: the sequence ends there, what
    comes after it is cut, and llguidance cannot roll an EOS back."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, constraint: OutputConstraint):
        self.constraint = constraint
        self.vocab_size = tokenizer.vocab_size
        self._eos = frozenset(tokenizer.eos_tokens)
        self._matcher = _llguidance().LLMatcher(tokenizer, constraint.grammar, log_level=0)
        self._drafted = 0  # consumed by `draft`
        self._draft_ended = False  # a draft was an EOS
        self._raise_if_error()

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        self._raise_if_error()
        if not mask.any():
            raise GrammarError(f"{self.constraint.param}: the grammar allows no token here")
        return mask

    def advance(self, tokens: list[int]) -> None:
        """Commit tokens the sequence produced (each allowed when sampled)."""
        for t in tokens:  # one by one: consume_tokens refuses an EOS once stopped
            self._consume(t)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def masks_along(self, drafts: list[int]) -> np.ndarray:
        """(len(drafts) + 1, V) bool: the mask here and after each draft
        (drafts the grammar accepts); the state is left where it was."""
        rows, consumed = [self.allowed()], 0
        for d in drafts:
            if d in self._eos:  # the rows after an EOS are never used
                rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
                break
            self._consume(d)
            consumed += 1
            rows.append(self.allowed())
        self._matcher.rollback(consumed)
        return np.stack(rows)

    def is_eos(self, token: int) -> bool:
        return token in self._eos

    def consume(self, token: int) -> None:
        """Take one token for now (masks_along's walk); `rollback` undoes it."""
        self._consume(token)

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)

    def draft(self, token: int) -> None:
        if self._draft_ended or token in self._eos:
            self._draft_ended = True
            return
        self._consume(token)
        self._drafted += 1

    def undo_drafts(self) -> None:
        if self._drafted:
            self._matcher.rollback(self._drafted)
        self._drafted, self._draft_ended = 0, False

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            self._raise_if_error()
            raise GrammarError(f"{self.constraint.param}: token {token} breaks the grammar")

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"{self.constraint.param}: {first_line(self._matcher.get_error())}")


def masked(logits: mx.array, allowed: mx.array | np.ndarray | None) -> mx.array:
    """`logits` (..., V) with the tokens the grammar forbids at -inf."""
    if allowed is None:
        return logits
    width = logits.shape[-1]
    allowed = mx.array(allowed) if isinstance(allowed, np.ndarray) else allowed
    if allowed.shape[-1] < width:  # logits padded past the tokenizer: never allowed
        pad = mx.zeros((*allowed.shape[:-1], width - allowed.shape[-1]), dtype=mx.bool_)
        allowed = mx.concatenate([allowed, pad], axis=-1)
    return mx.where(allowed, logits, NEG_INF)
