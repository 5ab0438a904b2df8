"""POST /v1/responses: OpenAI's Responses API over the same generation path
as chat completions (gateway/api/chat.py, gateway/serving/generation.py).

A response's output is a list of items: a reasoning item with a reasoning
model's thinking (its text in `content`, no summary), a message with the
text, and an item per tool call (function_call, custom_tool_call,
local_shell_call: gateway/api/responses_tools.py), in the order the model
wrote them.
Streamed, each item is announced, filled (text, argument or input deltas)
and closed, between `response.created` / `response.in_progress` and
`response.completed` (or `response.incomplete` when max_output_tokens cut
it), each event numbered. `previous_response_id` continues a stored
response: responses are kept in memory per API key (`store: false` keeps
none), each key within its own quota (`server.responses_store`), its least
recently used forgotten first; a forgotten or another key's id is a 404
naming the parameter.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import pydantic_core
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specgate.gateway.access.auth import current_principal
from specgate.gateway.api import structured
from specgate.gateway.api.chat import (
    ChatPrompt,
    ClientGone,
    first_piece,
    keepalive_comment,
    render_chat,
    until_disconnect,
)
from specgate.gateway.api.responses_schema import (
    CustomToolCallItem,
    FunctionCallItem,
    LocalShellCallItem,
    MessageItem,
    ResponsesRequest,
    image_refs,
    template_messages,
)
from specgate.gateway.api.responses_tools import ModelTools
from specgate.gateway.api.thinking import Thought
from specgate.gateway.api.tools import ToolCall
from specgate.gateway.errors import APIError
from specgate.gateway.serving import images
from specgate.gateway.serving.generation import (
    Usage,
    new_id,
    plan_headers,
    plan_request,
    resolve_model,
    run,
)

router = APIRouter()


@dataclass
class _Stored:
    parent: str | None  # the response it continued
    items: list  # the items it added: the request's new input, then its output
    size: int  # their JSON's bytes


class _KeyStore:
    """One key's responses, least recently used first."""

    def __init__(self):
        self.responses: OrderedDict[str, _Stored] = OrderedDict()
        self.size = 0


class ResponseStore:
    """Stored responses, each API key's apart: a key keeps at most
    `responses_per_key` responses and `bytes_per_key` bytes of items (as
    JSON), its least recently used forgotten first, so one key's traffic
    never evicts another key's conversations. Each response keeps the items
    it added to its conversation and the response it continued, so a long
    conversation is stored once, not once per turn; a response whose chain
    lost a link is forgotten too, and one larger than a key's whole quota is
    not kept. Items hold only the fields the API defines (responses_schema:
    unknown ones are dropped as the request is parsed)."""

    def __init__(self, responses_per_key: int, bytes_per_key: int):
        self.responses_per_key, self.bytes_per_key = responses_per_key, bytes_per_key
        self._keys: dict[str, _KeyStore] = {}
        self._lock = threading.Lock()

    def put(self, key: str, response_id: str, parent: str | None, items: list) -> None:
        size = len(pydantic_core.to_json(items))
        if size > self.bytes_per_key or self.responses_per_key == 0:
            return
        with self._lock:
            own = self._keys.setdefault(key, _KeyStore())
            own.responses[response_id] = _Stored(parent, items, size)
            own.size += size
            while len(own.responses) > self.responses_per_key or own.size > self.bytes_per_key:
                _, forgotten = own.responses.popitem(last=False)
                own.size -= forgotten.size

    def holds(self, key: str, response_id: str) -> bool:
        with self._lock:
            own = self._keys.get(key)
            return own is not None and response_id in own.responses

    def conversation(self, key: str, response_id: str) -> list | None:
        """Every item up to and including this response's output, or None."""
        chain: list[list] = []
        with self._lock:
            own = self._keys.get(key)
            at: str | None = response_id
            while at is not None:
                stored = own.responses.get(at) if own is not None else None
                if stored is None:
                    return None
                own.responses.move_to_end(at)
                at = stored.parent
                chain.append(stored.items)
        return [item for items in reversed(chain) for item in items]


class _Output:
    """Builds a response's output items from its text as it streams, and the
    events that announce them (`events` collects those not yet sent)."""

    def __init__(self, chat: ChatPrompt, tools: ModelTools):
        self.stream = chat.output_stream(tools.freeform)
        self.tools = tools
        self.items: list[dict] = []
        self.events: list[dict] = []
        self._message: dict | None = None  # the open message item
        self._reasoning: dict | None = None  # the open reasoning item

    def feed(self, text: str, token_ids: list[int], last: bool) -> None:
        parts = self.stream.feed(text, token_ids) + (self.stream.finish() if last else [])
        for part in parts:
            if isinstance(part, Thought):
                self._think(part.text)
                continue
            self._close_reasoning()
            if isinstance(part, ToolCall):
                self._close_message()
                self._call(part)
            elif part:
                self._text(part)
        if last:
            self._close_reasoning()
            self._close_message()

    def _think(self, text: str) -> None:
        if self._reasoning is None:
            self._reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                               "content": [], "status": "in_progress"}  # fmt: skip
            self.items.append(self._reasoning)
            self.events.append({"type": "response.output_item.added",
                                "output_index": len(self.items) - 1,
                                "item": self._reasoning | {"content": []}})  # fmt: skip
            self._reasoning["content"].append({"type": "reasoning_text", "text": ""})
            self.events.append({"type": "response.content_part.added", **self._in(self._reasoning),
                                "part": {"type": "reasoning_text", "text": ""}})  # fmt: skip
        self._reasoning["content"][0]["text"] += text
        self.events.append({"type": "response.reasoning_text.delta", **self._in(self._reasoning),
                            "delta": text})  # fmt: skip

    def _close_reasoning(self) -> None:
        if self._reasoning is None:
            return
        item, where = self._reasoning, self._in(self._reasoning)
        part = item["content"][0]
        self.events += [
            {"type": "response.reasoning_text.done", **where, "text": part["text"]},
            {"type": "response.content_part.done", **where, "part": dict(part)},
        ]
        item["status"] = "completed"
        self.events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                            "item": json.loads(json.dumps(item))})  # fmt: skip
        self._reasoning = None

    def _in(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _text(self, text: str) -> None:
        if self._message is None:
            self._message = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}  # fmt: skip
            self.items.append(self._message)
            index = len(self.items) - 1
            self.events.append({"type": "response.output_item.added", "output_index": index,
                                "item": self._message | {"content": []}})  # fmt: skip
            self._message["content"].append({"type": "output_text", "text": "", "annotations": []})
            self.events.append({"type": "response.content_part.added", **self._where(),
                                "part": {"type": "output_text", "text": "", "annotations": []}})
        self._message["content"][0]["text"] += text
        self.events.append({"type": "response.output_text.delta", **self._where(), "delta": text,
                            "logprobs": []})  # fmt: skip

    def _close_message(self) -> None:
        if self._message is None:
            return
        part = self._message["content"][0]
        self.events += [
            {"type": "response.output_text.done", **self._where(), "text": part["text"],
             "logprobs": []},
            {"type": "response.content_part.done", **self._where(), "part": dict(part)},
        ]  # fmt: skip
        self._message["status"] = "completed"
        self.events.append({"type": "response.output_item.done",
                            "output_index": self.items.index(self._message),
                            "item": json.loads(json.dumps(self._message))})  # fmt: skip
        self._message = None

    def _where(self) -> dict:
        return self._in(self._message)

    def _call(self, call: ToolCall) -> None:
        item = self.tools.output_item(call)
        self.items.append(item)
        index, where = len(self.items) - 1, {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            arguments = item["arguments"]
            filled = [
                {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
                {"type": "response.function_call_arguments.done", **where, "arguments": arguments,
                 "name": item["name"]},
            ]  # fmt: skip
            opened = item | {"arguments": "", "status": "in_progress"}
        elif item["type"] == "custom_tool_call":
            text = item["input"]
            filled = [{"type": "response.custom_tool_call_input.delta", **where, "delta": text},
                      {"type": "response.custom_tool_call_input.done", **where, "input": text}]
            opened = item | {"input": "", "status": "in_progress"}
        else:
            filled, opened = [], item | {"status": "in_progress"}
        self.events += [
            {"type": "response.output_item.added", "output_index": index, "item": opened},
            *filled,
            {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
        ]

    def as_items(self) -> list:
        """The output as input items, for a later previous_response_id."""
        out = []
        for item in self.items:
            if item["type"] == "reasoning":  # not kept: a later turn's context leaves it out
                continue
            fields = {k: v for k, v in item.items() if k not in ("id", "status")}
            if item["type"] == "message":
                out.append(MessageItem(role="assistant", content=item["content"][0]["text"]))
            elif item["type"] == "function_call":
                out.append(FunctionCallItem(**fields))
            elif item["type"] == "custom_tool_call":
                out.append(CustomToolCallItem(**fields))
            else:
                out.append(LocalShellCallItem(**fields))
        return out


def _usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}  # fmt: skip


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    served, engine = await resolve_model(request.app.state.registry, body.model)
    store: ResponseStore = request.app.state.responses
    key = current_principal().name
    history: list = []
    if body.previous_response_id is not None:
        history = store.conversation(key, body.previous_response_id)
        if history is None:
            raise APIError(404, f"previous_response_id: no stored response '"
                                f"{body.previous_response_id}' for this key (responses sent with "
                                "store: false are not kept, and each key's least recently used "
                                "are forgotten past its quota of "
                                f"{store.responses_per_key} responses and {store.bytes_per_key} "
                                "bytes)",
                           param="previous_response_id",
                           code="previous_response_not_found")  # fmt: skip
    items = history + body.items
    # A model that takes images gets a user message's images; another is
    # told each was left out (MediaPart), as for images in a tool's output.
    takes_images = engine.images_refused() is None
    refs = image_refs(items) if takes_images else []
    messages = template_messages(body.instructions, items, images=takes_images)
    if not messages:
        raise APIError(400, "input: nothing to respond to", param="input")
    chat = await render_chat(engine, body.model, messages, body.template_tools, body.parse_tools,
                             messages_param="input", ask=body.thinking_ask(served.config.thinking),
                             grammar=body.json_output is not None or body.forced_tools is not None,
                             tool_prompt=served.config.tool_prompt)  # fmt: skip
    prompt, boundaries, pictures = await images.with_images(
        engine, body.model, chat.tokens, chat.boundaries, refs, request.app.state.image_urls)
    tools = body.template_tools if chat.tool_format else []
    grammars = body.model_tools.grammars if chat.tool_format else {}
    output = await structured.checked_constraint(engine, body.json_output, body.forced_tools,
                                                 tools, chat.tool_format, grammars)  # fmt: skip
    if output is None and body.forced_tools is None:  # custom tools' inputs, among free text
        output = await structured.checked_tool_inputs(engine, tools, chat.tool_format, grammars,
                                                      body.sampling())  # fmt: skip
    if output is None and chat.prompted:  # tools left to the model, through specgate's prompt
        output = await structured.checked_prompted_calls(
            engine, tools, body.parallel_tool_calls is not False, body.sampling())
    req = plan_request(served, engine, request.headers, prompt,
                       replace(body.sampling(), constraint=output, thinking=chat.held),
                       body.max_output_tokens,
                       "max_output_tokens", prompt_param="input",
                       prompt_text=messages[-1]["content"], boundaries=boundaries,
                       images=pictures)  # fmt: skip
    usage = Usage(len(prompt))
    built = _Output(chat, body.model_tools)
    snapshot = {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "model": body.model, "output": [], "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "temperature": req.request.sampling.temperature,
        "top_p": req.request.sampling.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": _dump(body.tool_choice) or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text and body.text.format else {"type": "text"}},
        "previous_response_id": body.previous_response_id, "store": body.store,
        "metadata": body.metadata or {}, "truncation": "disabled", "usage": None,
    }  # fmt: skip

    def finished(finish: str | None) -> dict:
        incomplete = finish == "length"
        if body.store:
            store.put(key, snapshot["id"], body.previous_response_id,
                      body.items + built.as_items())
        return snapshot | {
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": json.loads(json.dumps(built.items)), "usage": _usage(usage),
        }  # fmt: skip

    pieces = run(served, req, [], usage, request.app.state.metrics)  # no stop strings here
    headers = plan_headers(req.plan)
    if not body.stream:
        try:
            finish = await until_disconnect(request, _drain(pieces, built))
        except ClientGone:
            return Response(status_code=499)
        usage.reasoning_tokens = built.stream.reasoning_tokens
        return JSONResponse(finished(finish), headers=headers)

    keepalive_s = request.app.state.keepalive_s
    try:
        start = await first_piece(request, pieces, keepalive_s)
    except ClientGone:
        return Response(status_code=499)

    async def events():
        number = 0

        def sse(event: dict) -> bytes:
            nonlocal number
            event = event | {"sequence_number": number}
            number += 1
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

        head = [{"type": "response.created", "response": snapshot},
                {"type": "response.in_progress", "response": snapshot}]  # fmt: skip
        try:
            if not start.done:  # the response starts now: created, then keep-alives
                yield b"".join(sse(e) for e in head)
                head = []
                async for _ in start.waiting(keepalive_s):
                    yield keepalive_comment(usage)
            piece, finish = start.piece(), None
            while piece is not None:
                built.feed(piece.text, piece.token_ids, piece.finish_reason is not None)
                usage.reasoning_tokens = built.stream.reasoning_tokens
                finish = piece.finish_reason or finish
                out = b"".join(sse(e) for e in head + built.events)
                head, built.events = [], []
                if out:
                    yield out
                piece = await anext(pieces, None)
            done = finished(finish)
            kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
            yield sse({"type": kind, "response": done})
        except APIError as e:
            yield sse({"type": "error", "code": e.code, "message": e.message, "param": e.param})
        finally:
            await start.close()

    return StreamingResponse(
        events(), media_type="text/event-stream",
        headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )  # fmt: skip


async def _drain(pieces, built: _Output) -> str | None:
    finish = None
    try:
        async for piece in pieces:
            built.feed(piece.text, piece.token_ids, piece.finish_reason is not None)
            finish = piece.finish_reason or finish
    finally:
        await pieces.aclose()
    built.events = []
    return finish


def _dump(choice) -> object:
    return choice.model_dump() if hasattr(choice, "model_dump") else choice
