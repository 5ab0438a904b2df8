"""A reasoning model's thinking: what a request asks of it, and its text apart from the answer.

- **Asking.** Each API has its own way to ask for thinking: Anthropic's
  `thinking` (enabled with `budget_tokens`, adaptive, disabled), OpenAI's
  `reasoning_effort` and, as vLLM and llama-server take it,
  `chat_template_kwargs.enable_thinking`, the Responses API's
  `reasoning.effort`. Each becomes a `ThinkingAsk`: on, off or unsaid, and
  a budget (an effort's from the model's `thinking:` settings,
  gateway/config.ThinkingConfig). `plan_thinking` turns it into the chat template's
  switch (`enable_thinking`, passed only to a template that reads it; unsaid,
  the template's default stands) and, once the prompt is rendered, into the
  engines' `ThinkingBudget` (engines/grammar/thinking.py: the closing marker
  forced when the budget is spent, an answer grammar after the thinking).
  A model that does not think ignores all of it; "off" on a model whose
  template cannot switch is a budget of 0.
- **Splitting.** `ThinkingStream` separates the thinking from the answer in
  the streamed text (the answer then goes to the tool-call parser:
  `OutputStream`). A prompt that ends inside thinking (Qwen3.5's opens
  `<think>\\n`) starts the output there; otherwise an output that begins
  with the opening marker thinks. Nothing is dropped: a thinking never
  closed within max_tokens is given as thinking. Markers and the
  whitespace that pads them are syntax, not text.
- **Signing.** Anthropic's thinking blocks carry a `signature`; specgate's
  is an HMAC of the text under a secret kept in SPECGATE_HOME
  (`thinking.key`), so a block sent back can be checked.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from specgate.engines.base import ThinkingBudget, ThinkingFormat
from specgate.engines.grammar.thinking import Phase, ThinkingTracker
from specgate.engines.home import thinking_key_file
from specgate.gateway.api.tools import ToolCall, ToolCallStream
from specgate.gateway.config import ThinkingConfig
from specgate.gateway.errors import APIError

log = logging.getLogger(__name__)

# OpenAI's reasoning efforts (chat `reasoning_effort`, Responses `reasoning.effort`).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_OFF = ("none", "minimal")  # what a local model does with "think very little": not at all


@dataclass(frozen=True)
class ThinkingAsk:
    """What a request asked: to think (True), not to (False) or nothing
    (None), and within how many thinking tokens (None: no budget)."""

    enabled: bool | None = None
    budget: int | None = None


UNSAID = ThinkingAsk()


def from_effort(effort: str | None, settings: ThinkingConfig) -> ThinkingAsk:
    if effort is None:
        return UNSAID
    if effort in _OFF:
        return ThinkingAsk(False)
    return ThinkingAsk(True, getattr(settings, effort))


def from_switch(enabled: bool | None, settings: ThinkingConfig) -> ThinkingAsk:
    """A bare on/off (chat_template_kwargs, Anthropic's adaptive)."""
    if enabled is None:
        return UNSAID
    return ThinkingAsk(True, settings.default) if enabled else ThinkingAsk(False)


def either(effort: ThinkingAsk, switch: ThinkingAsk, param: str) -> ThinkingAsk:
    """An effort and a switch in one request: the effort's budget, unless
    they contradict each other (a 400 naming `param`)."""
    if effort.enabled is None:
        return switch
    if switch.enabled is not None and switch.enabled != effort.enabled:
        raise APIError(400, f"{param}: asks for thinking {'on' if effort.enabled else 'off'}, "
                            "chat_template_kwargs.enable_thinking for the opposite",
                       param=param)  # fmt: skip
    return effort


@dataclass(frozen=True)
class ThinkingPlan:
    """A request's thinking for one model: the template's switch to pass,
    and, with the rendered prompt, what the engines and the output parser
    need."""

    form: ThinkingFormat | None
    enabled: bool | None  # the switch to pass, if the template takes one
    budget: int | None
    grammar: bool  # the answer is held to a grammar

    @property
    def template_kwargs(self) -> dict | None:
        if self.form is None or not self.form.switchable or self.enabled is None:
            return None
        return {"enable_thinking": self.enabled}

    def counting(self, prompt: list[int]) -> ThinkingBudget | None:
        """The markers and where the output starts, for splitting and
        counting (no budget); None for a model that does not think."""
        if self.form is None or not self.form.start_tokens or not self.form.end_tokens:
            return None
        return ThinkingBudget(self.form.start_tokens, self.form.end_tokens,
                              self.form.opened_by(prompt), None, self.form.start,
                              self.form.end)  # fmt: skip

    def held(self, counting: ThinkingBudget | None) -> ThinkingBudget | None:
        """What the engines hold the output to (SamplingParams.thinking), or
        None where nothing needs holding: no budget, and no grammar to keep
        until the thinking has ended (nor thinking to expect)."""
        if counting is None:
            return None
        switched_off = self.enabled is False and self.form.switchable and not counting.opened
        if switched_off:
            return None
        budget = 0 if self.enabled is False else self.budget
        after = self.grammar and self.form.grammar_after_thinking
        if budget is None and not after:
            return None
        return ThinkingBudget(counting.start, counting.end, counting.opened, budget,
                              counting.start_text, counting.end_text)  # fmt: skip


def plan_thinking(form: ThinkingFormat | None, ask: ThinkingAsk, grammar: bool) -> ThinkingPlan:
    """The thinking of a request (`ask`) on a model (`form`, None: it does
    not think); `grammar`: its answer is held to one. An engine that holds
    a grammar over the whole output (llama-server) gets the prompt with
    thinking off, so the grammar holds the answer."""
    if form is None:
        return ThinkingPlan(None, None, None, grammar)
    enabled = ask.enabled
    if grammar and not form.grammar_after_thinking and form.switchable:
        enabled = False
    return ThinkingPlan(form, enabled, ask.budget if enabled is not False else 0, grammar)


# -- the output ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thought:
    """Thinking text, as it streams."""

    text: str


class ThinkingStream:
    """Splits streamed model text into thinking (`Thought`) and answer text.

    What may be the start of a marker is held back until it is known; so is
    whitespace at the end of the thinking so far (it is dropped if the
    closing marker follows). The output does not depend on how the text is
    cut into pieces."""

    def __init__(self, start: str, end: str, opened: bool):
        self.start, self.end = start, end
        self.phase = Phase.THINKING if opened else Phase.BEFORE
        self._buf = ""
        self._at_start = True  # of the thinking, or of the answer after it: whitespace goes

    def feed(self, text: str) -> list[Thought | str]:
        self._buf += text
        out: list[Thought | str] = []
        while True:
            if self.phase is Phase.BEFORE:
                head = self._buf.lstrip()
                if head.startswith(self.start):
                    self._buf, self.phase = head[len(self.start) :], Phase.THINKING
                    continue
                if self.start.startswith(head):  # (an empty head too) not known yet
                    return out
                self.phase, self._at_start = Phase.ANSWER, False
                continue
            if self.phase is Phase.THINKING:
                if self._at_start:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return out
                    self._at_start = False
                end = self._buf.find(self.end)
                if end >= 0:
                    self._think(self._buf[:end].rstrip(), out)
                    self._buf, self.phase, self._at_start = (
                        self._buf[end + len(self.end) :],
                        Phase.ANSWER,
                        True,
                    )
                    continue
                keep = _partial_suffix(self._buf, self.end)
                body = self._buf[: len(self._buf) - keep]
                sendable = body.rstrip()  # trailing whitespace: held, the marker may follow
                self._think(sendable, out)
                self._buf = self._buf[len(sendable) :]
                return out
            if self._at_start:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._at_start = False
            if self._buf:
                out.append(self._buf)
            self._buf = ""
            return out

    def finish(self) -> list[Thought | str]:
        """The end of the output: a thinking never closed is thinking."""
        rest, self._buf = self._buf, ""
        if self.phase is Phase.THINKING:
            rest = rest.rstrip()
            return [Thought(rest)] if rest else []
        if self.phase is Phase.ANSWER and self._at_start:  # nothing but padding after the marker
            rest = rest.lstrip()
        return [rest] if rest else []

    @staticmethod
    def _think(text: str, out: list) -> None:
        if text:
            out.append(Thought(text))


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class OutputStream:
    """A generation's output as thinking, answer text and tool calls: the
    thinking split off first, the answer through the tool-call parser.
    Counts the tokens spent on thinking (markers included) as it goes."""

    def __init__(self, counting: ThinkingBudget | None, tools: ToolCallStream | None):
        self.thinking = (None if counting is None
                         else ThinkingStream(counting.start_text, counting.end_text, counting.opened))  # fmt: skip
        self.tools = tools
        self._tracker = ThinkingTracker(counting) if counting is not None else None

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    @property
    def reasoning_tokens(self) -> int:
        return self._tracker.spent if self._tracker is not None else 0

    def feed(self, text: str, token_ids: list[int] = ()) -> list[Thought | str | ToolCall]:
        if self._tracker is not None:
            for t in token_ids:
                if self._tracker.phase is Phase.ANSWER:
                    break
                self._tracker.feed(t)
        parts = self.thinking.feed(text) if self.thinking is not None else [text]
        return self._answer(parts)

    def finish(self) -> list[Thought | str | ToolCall]:
        parts = self.thinking.finish() if self.thinking is not None else []
        out = self._answer(parts)
        if self.tools is not None:
            out += self.tools.finish()
        return out

    def _answer(self, parts: list[Thought | str]) -> list[Thought | str | ToolCall]:
        out: list[Thought | str | ToolCall] = []
        for part in parts:
            if isinstance(part, Thought) or self.tools is None:
                if part:
                    out.append(part)
            else:
                out += self.tools.feed(part)
        return out


# -- signatures --------------------------------------------------------------------------------

_SIGNATURE_PREFIX = "sg1."


@functools.cache
def _key(path: Path) -> bytes:
    """This server's signing secret, made on first use (32 random bytes,
    readable by the owner only). Read once per process and home."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) >= 32:
            return key
        raise RuntimeError(f"{path}: the thinking-signature key is damaged; delete it") from None
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def sign(thinking: str) -> str:
    mac = hmac.new(_key(thinking_key_file()), thinking.encode(), hashlib.sha256).digest()
    return _SIGNATURE_PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def verify(thinking: str, signature: str | None) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(thinking), signature)
