"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specgate.engines.base import TokenLogprob
from specgate.gateway.api import structured
from specgate.gateway.api.chat import (
    ClientGone,
    FirstPiece,
    collect,
    first_piece,
    keepalive_comment,
    render_chat,
    until_disconnect,
)
from specgate.gateway.api.openai_schema import ChatCompletionRequest, CompletionRequest
from specgate.gateway.api.thinking import Thought
from specgate.gateway.api.tools import ToolCall
from specgate.gateway.errors import APIError
from specgate.gateway.serving import images
from specgate.gateway.serving.generation import (
    Piece,
    Usage,
    check_stops,
    new_id,
    plan_headers,
    plan_request,
    resolve_model,
    run,
)

router = APIRouter()

# OpenAI's documented default for /v1/completions without max_tokens (chat
# completions take the model's `default_max_tokens`).
COMPLETIONS_MAX_TOKENS = 16


def load_fields(running: int, waiting: int, capacity: int, state: str,
                error: str | None = None, memory: dict | None = None,
                notes: list[str] | None = None) -> dict:  # fmt: skip
    """The `specgate` field of a /v1/models entry (what a front node reads),
    with why the model's last load failed while it did, what it holds in
    memory (bytes by kind, and `resident`: its processes' measured size, the
    same memory again) and what it had to do to serve (`notes`)."""
    fields = {"running": running, "waiting": waiting, "max_concurrent": capacity, "state": state}
    if memory:
        fields["memory"] = memory
    if notes:
        fields["notes"] = notes
    return fields | {"error": error} if error else fields


def _usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- logprobs in the two OpenAI shapes ---------------------------------------


def _chat_logprobs(lps: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": lp.text,
                "logprob": lp.logprob,
                "bytes": list(lp.text.encode()),
                "top_logprobs": [
                    {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                    for t in lp.top
                ],
            }
            for lp in lps
        ]
    }


def _completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict:
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.text)
    return {
        "tokens": [lp.text for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in lps],
        "text_offset": offsets,
    }


# -- one driver for both endpoints -------------------------------------------


async def _respond(
    request: Request,
    pieces: AsyncIterator[Piece],
    headers: dict[str, str],
    stream: bool,
    include_usage: bool,
    usage: Usage,
    chunks: Callable[[Piece, int], list[dict]],
    final: Callable[[str, list[int], list[TokenLogprob] | None, str | None], dict],
    preamble: dict | None,
    progress: bool = False,
) -> Response:
    """Answer whole or as SSE; `chunks` makes the events of one piece (a
    chat stream parsing tool calls may hold a piece back or split it).
    `progress`: llama-server's `return_progress`, chunks that say how far
    the prompt's prefill is, before the first token."""
    if not stream:
        try:
            text, ids, lps, finish = await until_disconnect(request, collect(pieces))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(final(text, ids, lps, finish), headers=headers)

    keepalive_s = request.app.state.keepalive_s
    try:
        start = await first_piece(request, pieces, keepalive_s)
    except ClientGone:
        return Response(status_code=499)

    async def events():
        sent = 0
        # The preamble goes out in the same write as the first token.
        head = _sse(preamble) if preamble is not None else b""
        try:
            if progress:
                async for out in _prefill_progress(start, usage, keepalive_s,
                                                   final("", [], None, None)):  # fmt: skip
                    yield out
            else:
                async for _ in start.waiting(keepalive_s):
                    yield keepalive_comment(usage)
            piece = start.piece()
            while piece is not None:
                out = head + b"".join(_sse(c) for c in chunks(piece, sent))
                if out:
                    yield out
                head = b""
                sent += len(piece.text)
                piece = await anext(pieces, None)
            if include_usage:
                yield _sse(final("", [], None, None) | {"choices": [], "usage": _usage(usage)})
        except APIError as e:
            yield _sse(e.body())
        finally:
            await start.close()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


PROGRESS_EVERY_S = 0.5  # how often a stream asking for prefill progress may get it


async def _prefill_progress(start: FirstPiece, usage: Usage, keepalive_s: float,
                            base: dict) -> AsyncIterator[bytes]:  # fmt: skip
    """Until the first piece: a `prompt_progress` chunk whenever the prefill
    moved (at most every PROGRESS_EVERY_S), a keep-alive comment when it did
    not for `keepalive_s` (a wait for a slot, an engine that prefills in one
    piece). The chunk has no choices, so clients that only read choices
    skip it, as they skip the usage chunk."""
    t0 = quiet_since = time.monotonic()
    sent = None
    async for _ in start.waiting(min(keepalive_s, PROGRESS_EVERY_S)):
        now, p = time.monotonic(), usage.prefill
        if p is not None and p != sent and p.processed:  # (0: looked up, nothing in the cache yet)
            sent, quiet_since = p, now
            yield _sse(base | {"choices": [], "prompt_progress": {
                "total": p.total, "cache": p.cached, "processed": p.processed,
                "time_ms": round((now - t0) * 1000)}})  # fmt: skip
        elif now - quiet_since >= keepalive_s:
            quiet_since = now
            yield keepalive_comment(usage)


# -- routes --------------------------------------------------------------------


@router.get("/v1/models")
async def list_models(request: Request):
    """Each model with its load in a `specgate` field, which a front node
    routing to this one reads (gateway/cluster/peers.py). A failed load's
    error is there too: a request for the model gets the same in its 503
    (an engine's problem is for admins only: /ready, /admin/status).
    `context_length` (OpenRouter's name) is its context in tokens, prompt
    and completion, which `specgate launch` tells an agent: the loaded
    engine's, else the configured `max_context`, else null (not known
    before it loads)."""
    registry = request.app.state.registry
    created = request.app.state.started_at
    return {
        "object": "list",
        "data": [
            {"id": m.id, "object": "model", "created": created, "owned_by": "specgate",
             "specgate": load_fields(m.gate.running, m.gate.waiting, m.config.max_concurrent,
                                     "shutting_down" if registry.draining else m.state,
                                     m.error if m.engine is None else None,
                                     _memory_fields(m), m.notes()),
             "context_length": m.engine.max_context if m.engine is not None
                               else m.config.max_context}
            for m in registry.models.values()
        ],
    }  # fmt: skip


def _memory_fields(m) -> dict:
    memory = m.memory()
    if memory and (rss := m.resident()) is not None:
        memory = memory | {"resident": rss}
    return memory


def _tool_calls(calls: list[ToolCall], first_index: int = 0, stream: bool = False) -> list[dict]:
    out = []
    for i, call in enumerate(calls, first_index):
        entry = {"id": new_id("call"), "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        out.append({"index": i} | entry if stream else entry)
    return out


def _chat_finish(finish: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish == "stop" else finish


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    served, engine = await resolve_model(request.app.state.registry, body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    refs = body.image_refs()
    images.refused(engine, body.model, refs)
    messages = [m.as_template_input() for m in body.messages]
    json_output = body.response_format.json_output() if body.response_format else None
    chat = await render_chat(engine, body.model, messages, body.template_tools, body.parse_tools,
                             ask=body.thinking_ask(served.config.thinking),
                             grammar=json_output is not None or body.forced_tools is not None,
                             tool_prompt=served.config.tool_prompt)  # fmt: skip
    prompt, boundaries, pictures = await images.with_images(
        engine, body.model, chat.tokens, chat.boundaries, refs, request.app.state.image_urls)
    limit, limit_param = body.token_limit
    tools = body.template_tools if chat.tool_format else []
    output = await structured.checked_constraint(engine, json_output, body.forced_tools, tools,
                                                 chat.tool_format)  # fmt: skip
    sampling = body.sampling(body.logprobs, body.top_logprobs or 0)
    if output is None and chat.prompted:  # tools left to the model, through specgate's prompt
        output = await structured.checked_prompted_calls(
            engine, tools, body.parallel_tool_calls is not False, sampling)
    sampling = replace(sampling, constraint=output, thinking=chat.held)
    stops = check_stops(body.stop)
    req = plan_request(served, engine, request.headers, prompt, sampling, limit, limit_param,
                       body.ignore_eos, prompt_text=messages[-1]["content"],
                       boundaries=boundaries, images=pictures)  # fmt: skip
    usage = Usage(len(prompt))
    rid, created = new_id("chatcmpl"), int(time.time())
    base = {"id": rid, "created": created, "model": body.model}
    output_stream = chat.output_stream()

    def chunks(piece: Piece, _offset: int) -> list[dict]:
        before = output_stream.calls
        events = output_stream.feed(piece.text, piece.token_ids)
        if piece.finish_reason is not None:
            events += output_stream.finish()
        usage.reasoning_tokens = output_stream.reasoning_tokens
        deltas, index = [], before
        for e in events:
            if isinstance(e, ToolCall):
                deltas.append({"tool_calls": _tool_calls([e], index, stream=True)})
                index += 1
            elif isinstance(e, Thought):
                deltas.append({"reasoning_content": e.text})
            else:
                deltas.append({"content": e})
        called = output_stream.calls > 0
        out = []
        for i, delta in enumerate(deltas or [{}]):
            last = i == max(len(deltas), 1) - 1
            # The piece's tokens (logprobs, ids) go with its first event, its
            # finish reason with its last.
            choice = {"index": 0, "delta": delta,
                      "logprobs": _chat_logprobs(piece.logprobs) if piece.logprobs and i == 0
                      else None,
                      "finish_reason": _chat_finish(piece.finish_reason, called) if last
                      else None}
            if body.return_token_ids:
                choice["token_ids"] = piece.token_ids if i == 0 else []
            out.append(base | {"object": "chat.completion.chunk", "choices": [choice]})
        return out

    def final(text, ids, lps, finish) -> dict:
        whole = chat.output_stream()
        events = whole.feed(text, ids) + whole.finish()
        usage.reasoning_tokens = usage.reasoning_tokens or whole.reasoning_tokens
        calls = [e for e in events if isinstance(e, ToolCall)]
        thought = "".join(e.text for e in events if isinstance(e, Thought))
        text = "".join(e for e in events if isinstance(e, str))
        message = {"role": "assistant", "content": text if text or not calls else None}
        if thought:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = _tool_calls(calls)
        choice = {"index": 0, "message": message,
                  "logprobs": _chat_logprobs(lps) if body.logprobs else None,
                  "finish_reason": _chat_finish(finish, bool(calls))}
        if body.return_token_ids:
            choice["token_ids"] = ids
        if not body.stream:
            return base | {"object": "chat.completion", "choices": [choice], "usage": _usage(usage)}
        return base | {"object": "chat.completion.chunk"}

    preamble = base | {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
    }
    pieces = run(served, req, stops, usage, request.app.state.metrics)
    return await _respond(request, pieces, plan_headers(req.plan), body.stream,
                          body.include_usage, usage, chunks, final, preamble,
                          body.return_progress)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    served, engine = await resolve_model(request.app.state.registry, body.model)
    if isinstance(body.prompt, str):
        prompt = await engine.encode(body.prompt)
    else:
        prompt = list(body.prompt)
        bad = [t for t in prompt if t >= engine.vocab_size]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                                f"(size {engine.vocab_size})", param="prompt")
    want_lps = body.logprobs is not None
    sampling = body.sampling(want_lps, body.logprobs or 0)
    stops = check_stops(body.stop)
    req = plan_request(served, engine, request.headers, prompt, sampling, body.max_tokens,
                       ignore_eos=body.ignore_eos, prompt_param="prompt",
                       prompt_text=body.prompt if isinstance(body.prompt, str) else None,
                       default_max_tokens=COMPLETIONS_MAX_TOKENS)
    usage = Usage(len(prompt))
    rid, created = new_id("cmpl"), int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}

    def choice(text, ids, lps, finish, offset) -> dict:
        c = {"index": 0, "text": text,
             "logprobs": _completion_logprobs(lps, offset) if want_lps and lps is not None else None,
             "finish_reason": finish}
        if body.return_token_ids:
            c["token_ids"] = ids
        return c

    def chunks(piece: Piece, offset: int) -> list[dict]:
        return [base | {"choices": [choice(piece.text, piece.token_ids, piece.logprobs or [],
                                           piece.finish_reason, offset)]}]

    def final(text, ids, lps, finish) -> dict:
        if not body.stream:
            return base | {"choices": [choice(text, ids, lps, finish, 0)], "usage": _usage(usage)}
        return base

    pieces = run(served, req, stops, usage, request.app.state.metrics)
    return await _respond(request, pieces, plan_headers(req.plan), body.stream,
                          body.include_usage, usage, chunks, final, None, body.return_progress)
