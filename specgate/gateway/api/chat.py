"""What the chat adapters (OpenAI, Anthropic, Responses, Ollama) share past
their own schemas.

Each reduces a request to template messages and OpenAI-shaped tools, renders
them here through the model's chat template (deciding whether and how tool
calls are parsed, and the thinking's switch and budget: gateway/api/thinking.py),
and streams the generation through the same helpers for client disconnects,
the first piece and a whole answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from specgate.engines.base import (
    Engine,
    EngineError,
    EngineOverloaded,
    MessageBoundaries,
    ThinkingBudget,
    TokenLogprob,
)
from specgate.gateway.access import access_log
from specgate.gateway.api.thinking import UNSAID, OutputStream, ThinkingAsk, plan_thinking
from specgate.gateway.api.tools import (
    PROMPT_TOOL_FORMAT,
    ToolCallStream,
    ToolFormat,
    template_mentions_tools,
    tool_format,
    tools_as_text,
)
from specgate.gateway.errors import APIError
from specgate.gateway.serving.generation import Piece, Usage

T = TypeVar("T")
log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before its response started."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, cancelling it if the client goes away meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            # Wait for the cancel to land: until then `work` (e.g. an anext of
            # the request's stream) is still running, and closing that stream
            # fails with "aclose(): asynchronous generator is already running".
            await asyncio.wait({task})


def keepalive_comment(usage: Usage) -> bytes:
    """An SSE comment, which clients skip; during a prefill it says how far
    along it is, as mlx-lm's server does (`: keepalive 5120/20000`)."""
    if usage.prefill is None:
        return b": keepalive\n\n"
    return f": keepalive {usage.prefill.processed}/{usage.prefill.total}\n\n".encode()


class FirstPiece:
    """A stream's first piece, or the wait for it.

    It is awaited before the response starts, for `patience_s`, so that an
    overload or an engine error still gets its own status code rather than
    an error event. A first token slower than that (a long prompt's
    prefill, a wait for a slot) would leave the client with no byte at all,
    and a 100k-token agent turn looks like a dead server: the response then
    starts, and `waiting` paces keep-alives until the piece is there; an
    error after that is an error event in the stream, as later ones are."""

    def __init__(self, task: asyncio.Future, pieces: AsyncIterator[Piece]):
        self._task, self._pieces = task, pieces

    async def waiting(self, every_s: float, until: Callable[[], bool] | None = None,
                      ) -> AsyncIterator[None]:  # fmt: skip
        """While the first piece is not there: at once (the response starts
        only after `patience_s` of silence), then every `every_s` seconds.
        With `until`, it also stops once that holds (looked at every 50 ms)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not self._task.done() and not (until is not None and until()):
            if loop.time() >= due:
                yield
                due = loop.time() + every_s
            wait = due - loop.time() if until is None else min(UNTIL_POLL_S, due - loop.time())
            await asyncio.wait({self._task}, timeout=max(0.0, wait))

    @property
    def done(self) -> bool:
        return self._task.done()

    def piece(self) -> Piece | None:
        """The first piece (None: the stream was empty); raises what the
        generation raised before it."""
        return self._task.result()

    async def close(self) -> None:
        """Stop waiting (the client left) and close the stream."""
        if not self._task.done():
            self._task.cancel()
            # Until the cancel lands the anext still runs, and closing the
            # stream fails with "asynchronous generator is already running".
            await asyncio.wait({self._task})
        await self._pieces.aclose()


# How often FirstPiece.waiting looks at its `until` (a flag another task sets).
UNTIL_POLL_S = 0.05

# The least a stream waits for its first piece before its response starts,
# however long the request took to get there: an overload or an engine
# error raised at once still gets its own status code.
MIN_PATIENCE_S = 0.25


async def first_piece(request: Request, pieces: AsyncIterator[Piece],
                      patience_s: float = math.inf) -> FirstPiece:  # fmt: skip
    """Wait for a stream's first piece up to `patience_s` (FirstPiece),
    counted from the request's arrival (its access record): the time spent
    reading, rendering and tokenizing a long prompt is silence to the
    client too (a loaded 2-core machine took ~4.5 s for a 20k-token chat,
    which put the first keep-alive at 7 s with a 2.5 s period). Raises
    what the generation raised before that, and ClientGone (the stream
    closed) if the client left."""
    task = asyncio.ensure_future(anext(pieces, None))
    start = FirstPiece(task, pieces)
    loop = asyncio.get_running_loop()
    record = access_log.current()
    if record is not None and patience_s != math.inf:
        spent = time.perf_counter() - record.started
        patience_s = max(MIN_PATIENCE_S, patience_s - spent)
    deadline = loop.time() + patience_s
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=max(0.0, min(0.25, deadline - loop.time())))
            if task.done() or loop.time() >= deadline:
                break
            if await request.is_disconnected():
                raise ClientGone
        if task.done():
            task.result()
        return start
    except BaseException:
        await start.close()
        raise


async def collect(
    pieces: AsyncIterator[Piece],
) -> tuple[str, list[int], list[TokenLogprob], str | None]:
    """A whole answer: its text, token ids, logprobs and finish reason."""
    text, ids, lps, finish = [], [], [], None
    async with aclosing(pieces):
        async for piece in pieces:
            text.append(piece.text)
            ids.extend(piece.token_ids)
            if piece.logprobs:
                lps.extend(piece.logprobs)
            finish = piece.finish_reason or finish
    return "".join(text), ids, lps, finish


def late_system_as_user(messages: list[dict]) -> list[dict] | None:
    """The messages with each system message after the conversation began
    given the user role, or None where there is none. Agents send them
    mid-session (Codex's developer messages: a changed sandbox, a new
    working directory; Claude Code its environment, after the first user
    turn), and many templates, Qwen3.5's own among them, refuse a
    system message anywhere but first; read as the user's, they still reach
    the model. Only where the template refused them."""
    begun, moved, out = False, False, []
    for m in messages:
        if m.get("role") == "system" and begun:
            m, moved = m | {"role": "user"}, True
        begun = begun or m.get("role") != "system"
        out.append(m)
    return out if moved else None


async def _rendered(engine: Engine, messages: list[dict], tools: list[dict],
                    kwargs: dict | None) -> tuple[list[int], list[dict]]:  # fmt: skip
    """The template's tokens for the messages, and the messages it took:
    those given, or, where it refused a system message after the
    conversation began, those with it as the user's (late_system_as_user)."""
    try:
        return await engine.render_chat(messages, tools or None, kwargs), messages
    except (EngineOverloaded, EngineError):
        raise
    except Exception:
        if (moved := late_system_as_user(messages)) is None:
            raise
        tokens = await engine.render_chat(moved, tools or None, kwargs)
        log.debug("the chat template refused a system message after the conversation "
                  "began: sent as the user's")  # fmt: skip
        return tokens, moved


_SYSTEM_TURNS: dict[str, bool] = {}  # chat template -> whether it renders a system message


async def _renders_system(engine: Engine, template: str) -> bool:
    """Whether a chat template renders a system message: the prompt grows
    by it. Read by rendering, since a template may say no "system" and
    render every role (plain ChatML), or say it and drop or refuse it."""
    if (known := _SYSTEM_TURNS.get(template)) is not None:
        return known
    user = [{"role": "user", "content": "x"}]
    try:
        alone = await engine.render_chat(user, None, None)
        with_system = await engine.render_chat([{"role": "system", "content": "y " * 8}] + user,
                                               None, None)  # fmt: skip
        known = len(with_system) > len(alone)
    except (EngineOverloaded, EngineError):
        raise
    except Exception:  # the template refuses a system message (Gemma 2's raises)
        known = False
    if len(_SYSTEM_TURNS) < 64:  # a process serves few templates; never unbounded
        _SYSTEM_TURNS[template] = known
    return known


@dataclass
class ChatPrompt:
    tokens: list[int]
    tool_format: ToolFormat | None  # set when the output is parsed for tool calls
    tools: list[dict]  # OpenAI-shaped, as the parsers read parameter types
    boundaries: MessageBoundaries = MessageBoundaries()  # for the prefix cache
    # The model's thinking markers and whether the prompt opened thinking
    # (None: a model that does not think), and what the engines hold the
    # output to (SamplingParams.thinking: a budget, a grammar after thinking).
    thinking: ThinkingBudget | None = None
    held: ThinkingBudget | None = None
    # The tools reach the model through specgate's tool-use prompt
    # (tools.tools_as_text), not its template: with tools left to the
    # model, its output is then held to text and calls (structured.py).
    prompted: bool = False

    def tool_stream(self, freeform: frozenset[str] = frozenset()) -> ToolCallStream | None:
        """`freeform`: the tools whose one input is text (Responses' custom tools)."""
        if self.tool_format is None:
            return None
        return ToolCallStream(self.tool_format, self.tools, freeform)

    def output_stream(self, freeform: frozenset[str] = frozenset()) -> OutputStream:
        """The output as thinking, answer text and tool calls."""
        return OutputStream(self.thinking, self.tool_stream(freeform))


async def render_chat(
    engine: Engine,
    model_id: str,
    messages: list[dict],
    tools: list[dict],
    parse_tools: bool,
    *,
    messages_param: str = "messages",
    boundaries: bool = True,
    ask: ThinkingAsk = UNSAID,
    grammar: bool = False,
    tool_prompt: str | None = None,
) -> ChatPrompt:
    """Render through the model's chat template; with tools, check first that
    the template takes them and that its call format is one we can parse.
    `boundaries`: where its messages end, for the prefix cache (not needed
    to count tokens). `ask`: the request's thinking; `grammar`: its answer
    is held to a grammar (which then starts after the thinking).
    `tool_prompt`: the model's config key; "default" on a template without
    tools renders tools, calls and results as text (tools.tools_as_text), where
    tools are listed only if the output is parsed for calls (not with
    tool_choice "none")."""
    fmt, listed = None, tools
    candidates = [messages]  # what to render, in order, until a template takes one
    template = await engine.chat_template() if tools or tool_prompt else None
    prompted = (tool_prompt is not None and template is not None
                and not template_mentions_tools(template))  # fmt: skip
    if prompted:
        listed = tools if parse_tools else []
        # A template that renders no system turn gets the prompt in the first
        # user message; one that refuses a system message where this
        # conversation has it does too, on the second try.
        candidates = [tools_as_text(messages, listed, system_turn=False)]
        if listed and await _renders_system(engine, template):
            candidates.insert(0, tools_as_text(messages, listed))
        tools, fmt = [], PROMPT_TOOL_FORMAT
    elif tools:
        if template is None or not template_mentions_tools(template):
            raise APIError(
                400,
                f"tools: the chat template of model '{model_id}' does not support tools",
                param="tools",
                code="tools_unsupported",
            )
        fmt = tool_format(template)
        if fmt is None:
            raise APIError(
                400,
                f"tools: model '{model_id}' calls tools in a format specgate "
                "cannot parse (it parses the formats mlx-lm's tool parsers know: "
                "Qwen's JSON and XML calls, Mistral, GLM, Kimi, MiniMax, Gemma, ...)",
                param="tools",
                code="tools_unsupported",
            )
    form = await engine.thinking_format()
    # Tools left to the model through the prompt are held to a grammar too
    # (structured.checked_prompted_calls), after the thinking where the
    # engine can start it there; llama-server cannot take that grammar, so
    # there its thinking stays as asked.
    held_to_calls = prompted and parse_tools and form is not None and form.grammar_after_thinking
    planned = plan_thinking(form, ask, grammar or held_to_calls)
    kwargs = planned.template_kwargs
    try:
        for i, messages in enumerate(candidates):
            try:
                tokens, messages = await _rendered(engine, messages, tools, kwargs)
                break
            except (EngineOverloaded, EngineError):
                raise
            except Exception:
                if i == len(candidates) - 1:
                    raise
                log.debug("the chat template refused the tool-use prompt in a system message: "
                          "sent before the first user message")  # fmt: skip
    except EngineOverloaded:
        raise
    except EngineError as e:
        raise APIError(
            500, f"the model's chat template could not be applied: {e}", code="engine_error"
        ) from None
    except Exception as e:
        if await engine.chat_template() is None:  # not the messages: no template at all
            raise APIError(
                400,
                f"{messages_param}: model '{model_id}' has no chat template (a base model), so "
                "it cannot take chat messages; send a plain prompt to /v1/completions, or "
                "give the model a template: `chat_template:` in its config (a Jinja file's "
                "path or the template itself)",
                param=messages_param,
                code="chat_template_missing",
            ) from None
        raise APIError(
            400,
            f"{messages_param}: the model's chat template rejected them: {e}",
            param=messages_param,
        ) from None
    marks = (await engine.message_boundaries(messages, tools or None, tokens, kwargs) if boundaries
             else MessageBoundaries())  # fmt: skip
    counting = planned.counting(tokens)
    return ChatPrompt(tokens, fmt if parse_tools else None, listed, marks, counting,
                      planned.held(counting), prompted and parse_tools)
