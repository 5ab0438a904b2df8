"""Ollama's API, for the tools that speak only it (Open WebUI, Continue,
Zed, Raycast, ...): /api/version, /api/tags, /api/show, /api/ps,
/api/chat and /api/generate.

A request goes through the same API-neutral steps as on the other APIs:
the key, its quotas and its models (AuthMiddleware, resolve_model,
generation.run), the chat template and tool calls (chat.py, tools.py),
`format` as a structured output (structured.py), admission and metrics.
This module only speaks Ollama's shapes: NDJSON streams (one JSON object a
line) ending in a `done` object with Ollama's counts and durations (in
nanoseconds), tool calls with their arguments as an object, errors as
`{"error": "..."}` (gateway/errors.py), and after a stream began, a last
line of that shape (ollama-python raises it as its ResponseError).

Embeddings (/api/embed, /api/embeddings) are answered by
gateway/api/retrieval/. Not served: model management (pull, push, create,
copy, delete), since specgate serves the models its config names. Those
routes answer a 400 that says so, in Ollama's shape. A name with Ollama's default
tag (`tiny:latest`) is the model of that id. `GET /` stays specgate's
admin page (Ollama's "Ollama is running" text lives there); `HEAD /`
answers 200 as Ollama's does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response, StreamingResponse

from specgate.engines.base import Engine, OutputConstraint, TokenLogprob
from specgate.gateway.access.auth import current_principal
from specgate.gateway.api import structured
from specgate.gateway.api.chat import (
    ChatPrompt,
    ClientGone,
    collect,
    first_piece,
    render_chat,
    until_disconnect,
)
from specgate.gateway.api.ollama_schema import ChatRequest, GenerateRequest, Options, ShowRequest
from specgate.gateway.api.thinking import Thought
from specgate.gateway.api.tools import ToolCall, template_mentions_tools, tool_format
from specgate.gateway.errors import APIError
from specgate.gateway.serving import images
from specgate.gateway.serving.generation import (
    Piece,
    Usage,
    check_stops,
    find_model,
    new_id,
    plan_headers,
    plan_request,
    resolve_model,
    run,
)
from specgate.gateway.serving.model_card import ModelCard
from specgate.gateway.serving.models import ServedModel


class JsonBodies(APIRoute):
    """Every body read as JSON, whatever its Content-Type: Ollama's docs
    and clients send JSON without saying so (`curl -d`, the docs' own
    examples, says form-urlencoded), and Ollama reads it all the same."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            scope = request.scope | {"headers": [*headers, (b"content-type", b"application/json")]}
            return await handler(Request(scope, request.receive))

        return as_json


router = APIRouter(route_class=JsonBodies)

# The Ollama release whose API this mirrors (tools, `format` schemas,
# `think`, logprobs): clients compare it to enable features.
OLLAMA_VERSION = "0.13.0"
NDJSON = "application/x-ndjson"
LATEST = ":latest"  # Ollama's default tag
# Ollama's "forever" (keep_alive -1) is now plus the largest duration it holds.
FOREVER = timedelta(days=292 * 365)


def ollama_model_id(request: Request, name: str) -> str:
    models = request.app.state.registry.models
    if name not in models and name.endswith(LATEST):
        return name.removesuffix(LATEST)
    return name


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _now() -> str:
    return _iso(datetime.now(UTC))


def _at(epoch_s: float) -> str:
    return _iso(datetime.fromtimestamp(epoch_s, UTC))


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


# -- the model routes ------------------------------------------------------------------


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_VERSION}


def _details(card: ModelCard) -> dict:
    return {"parent_model": "", "format": card.format, "family": card.family,
            "families": [card.family] if card.family else None,
            "parameter_size": card.parameter_size, "quantization_level": card.quantization}  # fmt: skip


async def _usable(
    request: Request, loaded_only: bool = False
) -> list[tuple[ServedModel, ModelCard]]:
    """The models the caller's key may use, with their cards."""
    principal = current_principal()
    served = [m for m in request.app.state.registry.models.values()
              if principal.may_use(m.id) and (m.engine is not None or not loaded_only)]  # fmt: skip
    cards = request.app.state.model_cards
    return list(zip(served, await asyncio.gather(*(cards.of(m.config) for m in served)),
                    strict=True))  # fmt: skip


@router.get("/api/tags")
async def tags(request: Request):
    return {"models": [
        {"name": m.id, "model": m.id, "modified_at": _at(card.modified), "size": card.size,
         "digest": card.digest, "details": _details(card)}
        for m, card in await _usable(request)
    ]}  # fmt: skip


def _expires_at(served: ServedModel) -> str:
    """When an idle TTL would unload it; a model without one stays (as
    Ollama's keep_alive -1 does), unless evicted to make room."""
    now = datetime.now(UTC)
    ttl = None if served.pin else served.idle_ttl_s  # as an admin may have set them
    if ttl is None:
        return _iso(now + FOREVER)
    idle = 0.0 if served.busy else time.monotonic() - served.last_used
    return _iso(now + timedelta(seconds=max(0.0, ttl - idle)))


@router.get("/api/ps")
async def running(request: Request):
    models = []
    for m, card in await _usable(request, loaded_only=True):
        if m.engine is None:  # unloaded while the cards were read
            continue
        size = sum(m.memory().values())
        models.append({"name": m.id, "model": m.id, "size": size,
                       # Apple silicon's unified memory: the GPU reaches all of it.
                       "size_vram": size,
                       "digest": card.digest, "details": _details(card),
                       "expires_at": _expires_at(m), "context_length": m.engine.max_context})  # fmt: skip
    return {"models": models}


@router.post("/api/show")
async def show(body: ShowRequest, request: Request):
    """What Ollama's show says, read without loading the model: its context
    (the engine's once loaded) and whether it takes tools, which Continue and
    Open WebUI read from here."""
    served = find_model(request.app.state.registry, ollama_model_id(request, body.model_name))
    card = await request.app.state.model_cards.of(served.config)
    engine = served.engine
    template = await engine.chat_template() if engine is not None else card.chat_template
    context = engine.max_context if engine else served.config.max_context or card.context_length
    family = card.family or "unknown"
    info = {"general.architecture": family, "general.basename": served.id}
    if card.parameters:
        info["general.parameter_count"] = card.parameters
    if context:
        info[f"{family}.context_length"] = context
    # A template without tools takes them through specgate's tool-use prompt
    # where the model opts in (tools.tools_as_text).
    takes_tools = tool_format(template) or (served.config.tool_prompt and template
                                            and not template_mentions_tools(template))
    capabilities = ["completion"] + (["tools"] if takes_tools else [])
    # An embedding model (gateway/api/retrieval/) says so, as Ollama's do; one
    # whose task is found in its checkpoint says it once loaded.
    if (getattr(engine, "task", None) or served.config.task) == "embed":
        capabilities = ["embedding"]
    parameters = f"num_ctx {context}" if context else ""
    modelfile = (f"# {served.id} is served from specgate's config\nFROM {served.id}\n"
                 + (f"PARAMETER {parameters}\n" if parameters else ""))  # fmt: skip
    return {"modelfile": modelfile, "parameters": parameters, "template": template or "",
            "details": _details(card), "model_info": info, "capabilities": capabilities,
            "modified_at": _at(card.modified)}  # fmt: skip


# -- what specgate does not serve --------------------------------------------------------
# Clear answers to Ollama's clients rather than a bare 404; not in specgate's
# OpenAPI schema, since they are no part of its API.

_MANAGED = ("specgate serves the models its config names: add or change one in its config "
            "and reload it (`POST /admin/reload` or SIGHUP)")  # fmt: skip


def _refusal(message: str):
    async def refuse():
        raise APIError(400, message, code="unsupported")

    return refuse


for _path, _methods, _what in (
    ("/api/pull", ["POST"], "pulling models"),
    ("/api/push", ["POST"], "pushing models"),
    ("/api/create", ["POST"], "creating models"),
    ("/api/copy", ["POST"], "copying models"),
    ("/api/delete", ["DELETE"], "deleting models"),
    ("/api/blobs/{digest}", ["HEAD", "POST"], "model blobs"),
):
    router.add_api_route(_path, _refusal(f"{_what} is not supported: {_MANAGED}"),
                         methods=_methods, include_in_schema=False)  # fmt: skip


# -- generation --------------------------------------------------------------------------


@dataclass
class _Clock:
    """perf_counter times of a request, for Ollama's durations."""

    start: float
    loaded: float = 0.0
    first: float | None = None
    last: float | None = None

    async def timed(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
        async with aclosing(pieces):
            async for piece in pieces:
                self.last = time.perf_counter()
                self.first = self.first or self.last
                yield piece

    def stats(self, usage: Usage) -> dict:
        now = time.perf_counter()
        first = self.first or now

        def ns(seconds: float) -> int:
            return max(0, round(seconds * 1e9))

        return {"total_duration": ns(now - self.start), "load_duration": ns(self.loaded - self.start),
                "prompt_eval_count": usage.prompt_tokens,
                "prompt_eval_duration": ns(first - self.loaded),
                "eval_count": usage.completion_tokens,
                "eval_duration": ns((self.last or first) - first)}  # fmt: skip


def _logprobs(lps: list[TokenLogprob]) -> list[dict]:
    def one(lp) -> dict:
        return {"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode())}

    return [one(lp) | {"top_logprobs": [one(t) for t in lp.top]} for lp in lps]


def _tool_calls(calls: list[ToolCall], first_index: int = 0) -> list[dict]:
    return [{"id": new_id("call"),
             "function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls, first_index)]  # fmt: skip


class _Shape:
    """One of the two answers' objects: a chat message or a generated response."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat

    def chunk(self, text: str, calls: list[dict] | None = None,
              lps: list[TokenLogprob] | None = None, done: bool = False,
              thinking: str = "") -> dict:  # fmt: skip
        out: dict = {"model": self.model, "created_at": _now()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text} | (
                {"thinking": thinking} if thinking else {}) | (
                {"tool_calls": calls} if calls else {}
            )  # fmt: skip
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if lps is not None:
            out["logprobs"] = _logprobs(lps)
        return out | {"done": done}

    def loaded(self) -> dict:
        """The answer to a request with nothing to generate: the model is loaded."""
        return self.chunk("", done=True) | {"done_reason": "load"}


def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


def _token_limit(
    opts: Options, engine: Engine, served: ServedModel, n_prompt: int
) -> tuple[int | None, str]:
    """num_predict within num_ctx, or the model's context: (max_tokens, the
    param it came from). -1 and -2 (Ollama's "until the context ends" and
    "fill it"): what the context leaves."""
    param = "options.num_predict"
    context = engine.max_context
    if opts.num_ctx is not None:
        if opts.num_ctx > context:
            raise APIError(400, f"options.num_ctx: {opts.num_ctx} tokens, but model '{served.id}' "
                                f"has a context of {context} tokens", param="options.num_ctx",
                           code="context_length_exceeded")  # fmt: skip
        context = opts.num_ctx
        if n_prompt >= context:
            raise APIError(400, f"the prompt is {n_prompt} tokens; options.num_ctx is {context}, "
                                "which leaves no room to generate", param="options.num_ctx",
                           code="context_length_exceeded")  # fmt: skip
    room = context - n_prompt
    predict = opts.num_predict
    if predict is None:  # the model's default, as on the other APIs, within num_ctx
        default = None if opts.num_ctx is None else min(room, served.config.default_max_tokens)
        return default, param
    if predict < 0:
        return room, param
    if opts.num_ctx is not None and predict > room:
        raise APIError(400, f"options.num_predict: {predict} tokens requested, but the prompt is "
                            f"{n_prompt} tokens and options.num_ctx {context}: at most {room} can "
                            "be generated", param=param, code="context_length_exceeded")  # fmt: skip
    return predict, param


async def _answer(
    request: Request,
    body: ChatRequest | GenerateRequest,
    served: ServedModel,
    engine: Engine,
    clock: _Clock,
    tokens: list[int],
    constraint: OutputConstraint | None,
    chat: ChatPrompt | None,
    prompt_text: str,
    **plan,
) -> Response:
    """Generate, and answer whole or as an NDJSON stream. `chat`: a prompt
    rendered through the template, whose output is split into thinking,
    text and tool calls (None: a raw prompt, all text)."""
    opts = body.sampling_options
    sampling = replace(opts.sampling(body.logprobs, body.top_logprobs or 0), constraint=constraint,
                       thinking=chat.held if chat is not None else None)  # fmt: skip
    max_tokens, limit_param = _token_limit(opts, engine, served, len(tokens))
    stops = check_stops(opts.stop, "options.stop")
    req = plan_request(served, engine, request.headers, tokens, sampling, max_tokens, limit_param,
                       prompt_text=prompt_text, **plan)  # fmt: skip
    usage = Usage(len(tokens))
    shape = _Shape(body.model, isinstance(body, ChatRequest))
    pieces = clock.timed(run(served, req, stops, usage, request.app.state.metrics))
    headers = plan_headers(req.plan)
    want_lps = body.logprobs

    if not body.stream:
        try:
            text, _, got, finish = await until_disconnect(request, collect(pieces))
        except ClientGone:
            return Response(status_code=499)
        thinking, found = "", []
        if chat is not None:
            whole = chat.output_stream()
            thinking, text, found = _parts(whole.feed(text) + whole.finish())
        answer = shape.chunk(text, _tool_calls(found), got if want_lps else None, True, thinking)
        return JSONResponse(answer | {"done_reason": _done_reason(finish)} | clock.stats(usage),
                            headers=headers)  # fmt: skip

    keepalive_s = request.app.state.keepalive_s
    try:
        start = await first_piece(request, pieces, keepalive_s)
    except ClientGone:
        return Response(status_code=499)

    output = chat.output_stream() if chat is not None else None

    async def lines():
        finish, called = None, 0
        try:
            # NDJSON has no comments: Ollama's clients parse every line as
            # JSON (ollama-python's json.loads raises on a blank one). So the
            # keep-alive during a slow first token is a chunk of the stream
            # with nothing in it (empty content, not done), which every
            # client appends as nothing; sending no bytes at all would look
            # like a dead server to a client's or a proxy's read timeout.
            async for _ in start.waiting(keepalive_s):
                yield _line(shape.chunk(""))
            piece = start.piece()
            while piece is not None:
                events = (output.feed(piece.text, piece.token_ids) if output is not None
                          else [piece.text])  # fmt: skip
                thinking, text, found = _parts(events)
                if text or found or thinking or (want_lps and piece.logprobs):
                    yield _line(shape.chunk(text, _tool_calls(found, called),
                                            piece.logprobs if want_lps else None,
                                            thinking=thinking))  # fmt: skip
                called += len(found)
                finish = piece.finish_reason or finish
                piece = await anext(pieces, None)
            if output is not None:
                thinking, text, found = _parts(output.finish())
                if text or found or thinking:
                    yield _line(shape.chunk(text, _tool_calls(found, called), thinking=thinking))
            done = shape.chunk("", done=True) | {"done_reason": _done_reason(finish)}
            yield _line(done | clock.stats(usage))
        except APIError as e:
            yield _line(e.body("ollama"))
        finally:
            await start.close()

    return StreamingResponse(lines(), media_type=NDJSON,
                             headers=headers | {"Cache-Control": "no-cache",
                                                "X-Accel-Buffering": "no"})  # fmt: skip


def _parts(events: list) -> tuple[str, str, list[ToolCall]]:
    """An output's events as (thinking, text, tool calls)."""
    thinking = "".join(e.text for e in events if isinstance(e, Thought))
    text = "".join(e for e in events if isinstance(e, str))
    return thinking, text, [e for e in events if isinstance(e, ToolCall)]


def _loaded(body: ChatRequest | GenerateRequest) -> Response:
    answer = _Shape(body.model, isinstance(body, ChatRequest)).loaded()
    if body.stream:
        return Response(_line(answer), media_type=NDJSON)
    return JSONResponse(answer)


async def _resolve(body: ChatRequest | GenerateRequest, request: Request
                   ) -> tuple[_Clock, str, ServedModel, Engine]:  # fmt: skip
    """The request's model, loaded if need be, with the clock that times the load."""
    clock = _Clock(time.perf_counter())
    model_id = ollama_model_id(request, body.model)
    served, engine = await resolve_model(request.app.state.registry, model_id)
    clock.loaded = time.perf_counter()
    return clock, model_id, served, engine


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request):
    clock, model_id, served, engine = await _resolve(body, request)
    if not body.messages:
        return _loaded(body)
    refs = body.image_refs()
    images.refused(engine, model_id, refs)
    messages = body.template_messages()
    prompt = await render_chat(engine, model_id, messages, body.template_tools, bool(body.tools),
                               ask=body.thinking_ask(served.config.thinking),
                               grammar=body.json_output is not None,
                               tool_prompt=served.config.tool_prompt)  # fmt: skip
    tokens, boundaries, pictures = await images.with_images(
        engine, model_id, prompt.tokens, prompt.boundaries, refs, request.app.state.image_urls)
    tools = body.template_tools if prompt.tool_format else []
    constraint = await structured.checked_constraint(engine, body.json_output, None, tools,
                                                     prompt.tool_format)  # fmt: skip
    if constraint is None and prompt.prompted:  # tools left to the model, through specgate's prompt
        sampling = body.sampling_options.sampling(body.logprobs, body.top_logprobs or 0)
        constraint = await structured.checked_prompted_calls(engine, tools, True, sampling)
    return await _answer(request, body, served, engine, clock, tokens, constraint,
                         prompt, messages[-1]["content"], boundaries=boundaries, images=pictures)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request):
    clock, model_id, served, engine = await _resolve(body, request)
    if not body.prompt and not body.images:
        return _loaded(body)
    refs = body.image_refs()
    images.refused(engine, model_id, refs)
    pictures = ()
    if body.raw or await engine.chat_template() is None:
        # Ollama's template for a model without one is the prompt itself.
        if body.system and not body.raw:
            raise APIError(400, f"system: model '{model_id}' has no chat template to place a "
                                "system prompt in", param="system")  # fmt: skip
        if refs:
            raise APIError(400, f"images: model '{model_id}' has no chat template to place "
                                "them in", param="images")  # fmt: skip
        tokens, boundaries, prompt = await engine.encode(body.prompt), None, None
    else:
        prompt = await render_chat(engine, model_id, body.template_messages(), [], False,
                                   messages_param="prompt",
                                   ask=body.thinking_ask(served.config.thinking),
                                   grammar=body.json_output is not None)  # fmt: skip
        tokens, boundaries, pictures = await images.with_images(
            engine, model_id, prompt.tokens, prompt.boundaries, refs, request.app.state.image_urls)
    constraint = await structured.checked_constraint(engine, body.json_output, None, [], None)
    return await _answer(request, body, served, engine, clock, tokens, constraint, prompt,
                         body.prompt, prompt_param="prompt", boundaries=boundaries,
                         images=pictures)  # fmt: skip
