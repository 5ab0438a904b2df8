"""Anthropic-compatible routes: /v1/messages and /v1/messages/count_tokens.

The request goes through the same API-neutral steps as OpenAI's chat
completions (gateway/serving/generation.py, gateway/api/chat.py); this module only
speaks Anthropic's shapes: content blocks in and out (a reasoning model's
thinking as a `thinking` block first, signed: gateway/api/thinking.py), stop
reasons, and the streaming event sequence message_start, content_block_start,
ping, content_block_delta..., content_block_stop, message_delta, message_stop.

Stop sequences are matched here rather than in generation.run, because
Anthropic names the one that matched (`stop_sequence`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specgate.gateway.api import structured
from specgate.gateway.api.anthropic_schema import CountTokensRequest, MessagesRequest
from specgate.gateway.api.chat import (
    ClientGone,
    first_piece,
    keepalive_comment,
    render_chat,
    until_disconnect,
)
from specgate.gateway.api.thinking import OutputStream, Thought, sign
from specgate.gateway.api.tools import ToolCall
from specgate.gateway.errors import APIError
from specgate.gateway.serving import images
from specgate.gateway.serving.generation import (
    Piece,
    Usage,
    check_stops,
    plan_headers,
    plan_request,
    resolve_model,
    run,
)

router = APIRouter()

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class _Outcome:
    stop_reason: str | None = None
    stop_sequence: str | None = None


async def _output(
    pieces: AsyncIterator[Piece],
    output: OutputStream,
    outcome: _Outcome,
) -> AsyncIterator[Thought | str | ToolCall]:
    """The model's output as thinking, text and tool calls; sets `outcome` at the end."""
    async with aclosing(pieces):
        async for piece in pieces:
            text, finish = piece.text, piece.finish_reason
            if piece.stop_sequence is not None:
                finish = "stop_sequence"
            events = output.feed(text, piece.token_ids)
            if finish is not None:
                events += output.finish()
            for event in events:
                if event:
                    yield event
            if finish is not None:
                if finish == "stop_sequence":
                    outcome.stop_reason, outcome.stop_sequence = finish, piece.stop_sequence
                elif output.calls and finish == "stop":
                    outcome.stop_reason = "tool_use"
                else:
                    outcome.stop_reason = _STOP_REASONS.get(finish, "end_turn")
                return


async def _prepend(first: Piece | None, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    async with aclosing(rest):
        if first is not None:
            yield first
            async for piece in rest:
                yield piece


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": _id("toolu"), "name": call.name, "input": call.arguments}


class _Blocks:
    """Thinking, text and tool calls as Anthropic's content block events, in order.

    Consecutive text shares one text block, consecutive thinking one
    thinking block (its signature, over the whole text, in a signature_delta
    before it stops); each tool call is a block of its own, sent whole
    (start, its input as one input_json_delta, stop) because it is parsed
    only once complete.
    """

    def __init__(self):
        self.index = -1
        self.open_text = False
        self.thinking: str | None = None  # the open thinking block's text
        self.pinged = False

    def _start(self, block: dict) -> list[dict]:
        out = self._stop_text()
        self.index += 1
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        if not self.pinged:  # Anthropic sends one ping after the first block starts
            out.append({"type": "ping"})
            self.pinged = True
        return out

    def _stop_text(self) -> list[dict]:
        if self.thinking is not None:
            delta = {"type": "signature_delta", "signature": sign(self.thinking)}
            self.thinking = None
            return [{"type": "content_block_delta", "index": self.index, "delta": delta},
                    {"type": "content_block_stop", "index": self.index}]  # fmt: skip
        if not self.open_text:
            return []
        self.open_text = False
        return [{"type": "content_block_stop", "index": self.index}]

    def thought(self, text: str) -> list[dict]:
        out = []
        if self.thinking is None:
            out = self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking = ""
        self.thinking += text
        delta = {"type": "thinking_delta", "thinking": text}
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def text(self, text: str) -> list[dict]:
        out = [] if self.open_text else self._start({"type": "text", "text": ""})
        self.open_text = True
        delta = {"type": "text_delta", "text": text}
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def tool(self, call: ToolCall) -> list[dict]:
        out = self._start(_tool_use(call) | {"input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}
        return out + [
            {"type": "content_block_delta", "index": self.index, "delta": delta},
            {"type": "content_block_stop", "index": self.index},
        ]

    def close(self) -> list[dict]:
        """The last events; a message with nothing in it gets one empty text block."""
        out = []
        if self.index < 0:
            out = self._start({"type": "text", "text": ""})
            self.open_text = True
        return out + self._stop_text()


def _usage(usage: Usage) -> dict:
    """Input tokens as Anthropic counts them: those read from the prefix cache
    apart (clients add the three up); nothing is billed as a cache write."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
            "cache_creation_input_tokens": 0}  # fmt: skip


def _sse(event: dict) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    served, engine = await resolve_model(request.app.state.registry, body.model)
    refs = body.image_refs()
    images.refused(engine, body.model, refs)
    chat = await render_chat(engine, body.model, body.template_messages(), body.template_tools,
                             body.parse_tools, boundaries=False,
                             ask=body.thinking_ask(served.config.thinking),
                             tool_prompt=served.config.tool_prompt)  # fmt: skip
    tokens, _, _ = await images.with_images(engine, body.model, chat.tokens, chat.boundaries, refs,
                                            request.app.state.image_urls)  # fmt: skip
    return {"input_tokens": len(tokens)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    served, engine = await resolve_model(request.app.state.registry, body.model)
    refs = body.image_refs()
    images.refused(engine, body.model, refs)
    messages = body.template_messages()
    chat = await render_chat(engine, body.model, messages, body.template_tools, body.parse_tools,
                             ask=body.thinking_ask(served.config.thinking),
                             grammar=body.forced_tools is not None,
                             tool_prompt=served.config.tool_prompt)  # fmt: skip
    prompt, boundaries, pictures = await images.with_images(
        engine, body.model, chat.tokens, chat.boundaries, refs, request.app.state.image_urls)
    stops = check_stops(body.stop_sequences, "stop_sequences")
    output = await structured.checked_constraint(engine, None, body.forced_tools, [],
                                                 chat.tool_format)  # fmt: skip
    if output is None and chat.prompted:  # tools left to the model, through specgate's prompt
        output = await structured.checked_prompted_calls(
            engine, chat.tools, body.parallel_tool_use, body.sampling())
    req = plan_request(
        served, engine, request.headers, prompt,
        replace(body.sampling(), constraint=output, thinking=chat.held),
        body.max_tokens,
        prompt_text=messages[-1]["content"], boundaries=boundaries, images=pictures,
    )  # fmt: skip
    usage = Usage(len(prompt))
    outcome = _Outcome()
    head = {
        "id": _id("msg"),
        "type": "message",
        "role": "assistant",
        "model": body.model,
    }
    pieces = run(served, req, stops, usage, request.app.state.metrics)
    headers = plan_headers(req.plan)

    if not body.stream:

        async def collect() -> list[dict]:
            content: list[dict] = []
            async for event in _output(pieces, chat.output_stream(), outcome):
                if isinstance(event, ToolCall):
                    content.append(_tool_use(event))
                elif isinstance(event, Thought):
                    if content and content[-1]["type"] == "thinking":
                        content[-1]["thinking"] += event.text
                    else:
                        content.append({"type": "thinking", "thinking": event.text})
                elif content and content[-1]["type"] == "text":
                    content[-1]["text"] += event
                else:
                    content.append({"type": "text", "text": event})
            for block in content:
                if block["type"] == "thinking":
                    block["signature"] = sign(block["thinking"])
            return content or [{"type": "text", "text": ""}]

        try:
            content = await until_disconnect(request, collect())
        except ClientGone:
            return Response(status_code=499)
        message = head | {
            "content": content,
            "stop_reason": outcome.stop_reason,
            "stop_sequence": outcome.stop_sequence,
            "usage": _usage(usage) | {"output_tokens": usage.completion_tokens},
        }
        return JSONResponse(message, headers=headers)

    keepalive_s = request.app.state.keepalive_s
    try:
        start = await first_piece(request, pieces, keepalive_s)
    except ClientGone:
        return Response(status_code=499)

    async def events():
        try:
            # message_start comes first and carries the prompt's usage, whose
            # cache reads are known once the engine looked the prompt up (its
            # first PrefillProgress); a prompt waiting for that (queued, or the
            # engine busy) keeps the connection alive with SSE comments, which
            # every client skips, where an event before message_start would break
            # Anthropic's order.
            async for _ in start.waiting(keepalive_s, until=lambda: usage.prefill is not None):
                yield keepalive_comment(usage)
            opening = head | {
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(usage) | {"output_tokens": 0},
            }
            yield _sse({"type": "message_start", "message": opening})
            blocks = _Blocks()
            async for _ in start.waiting(keepalive_s):
                yield _sse({"type": "ping"})  # Anthropic's own keep-alive event
            output = _output(_prepend(start.piece(), pieces), chat.output_stream(), outcome)
            async with aclosing(output):
                async for event in output:
                    if isinstance(event, ToolCall):
                        out = blocks.tool(event)
                    elif isinstance(event, Thought):
                        out = blocks.thought(event.text)
                    else:
                        out = blocks.text(event)
                    yield b"".join(_sse(e) for e in out)
            delta = {"stop_reason": outcome.stop_reason, "stop_sequence": outcome.stop_sequence}
            out = blocks.close() + [
                # Cumulative, as Anthropic's own: its input counts too.
                {"type": "message_delta", "delta": delta,
                 "usage": _usage(usage) | {"output_tokens": usage.completion_tokens}},
                {"type": "message_stop"},
            ]  # fmt: skip
            yield b"".join(_sse(e) for e in out)
        except APIError as e:
            yield _sse(e.body("anthropic"))
        finally:
            await start.close()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
