"""Turning a parsed API request into a running generation, API-neutral.

The OpenAI (and later Anthropic) adapters parse their own bodies, then call
`resolve_model`, `plan_request` and `run` here, so limits, plan headers,
stop strings and usage are handled once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field

from specgate.engines.base import (
    PLAIN,
    Engine,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    GenerationRequest,
    Handoff,
    ImageInput,
    MessageBoundaries,
    Plan,
    Planner,
    PrefillProgress,
    RoundStats,
    SamplingParams,
    TokenLogprob,
)
from specgate.engines.registry import methods as known_methods
from specgate.gateway.access import access_log
from specgate.gateway.access.admission import GateClosed, QueueFull, QueueTimeout
from specgate.gateway.access.auth import Principal, current_principal
from specgate.gateway.access.quotas import Rejected
from specgate.gateway.errors import APIError
from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.models import ModelRegistry, ServedModel, answering
from specgate.gateway.serving.stops import StopMatcher
from specgate.policies.content import ContentClass, content_class
from specgate.policies.decide import FixedPlanner, OverrideError, RequestFeatures
from specgate.policies.model_policy import LivePolicy

log = logging.getLogger(__name__)

METHOD_HEADER = "x-specgate-method"
DEPTH_HEADER = "x-specgate-depth"
PLAN_HEADER = "X-Specgate-Plan"
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass
class Piece:
    """Text ready to send, with the tokens behind it."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_sequence: str | None = None  # the stop string that ended generation, if one did


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Before the first token: how far the prompt's prefill is (the engine's
    # latest PrefillProgress), which a stream's keep-alives report.
    prefill: PrefillProgress | None = None
    reasoning_tokens: int = 0  # of the completion's, spent on thinking (the API adapters count)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def find_model(registry: ModelRegistry, model_id: str) -> ServedModel:
    """The model a request names, if the caller's key may use it (403, 404
    otherwise); not loaded (resolve_model loads it)."""
    principal = current_principal()
    if not principal.may_use(model_id):
        # Checked before existence, so a key learns nothing of models beyond its own.
        allowed = ", ".join(sorted(principal.models or ())) or "none"
        raise APIError(
            403, f"this API key may not use model '{model_id}'; its models: {allowed}",
            param="model", code="model_not_allowed",
        )
    served = registry.get(model_id)
    if served is None:
        raise APIError(
            404,
            f"model '{model_id}' does not exist; served models: {', '.join(registry.models)}",
            param="model",
            code="model_not_found",
        )
    if (record := access_log.current()) is not None:
        record.model = served.id
    return served


async def resolve_model(registry: ModelRegistry, model_id: str,
                        task: str | None = "generate") -> tuple[ServedModel, Engine]:  # fmt: skip
    """The model, loaded and held until the response ends; for a generation
    (`task`), a 400 if the model serves embeddings or rerank scores."""
    if registry.draining and current_principal().may_use(model_id):
        raise shutting_down()
    served = find_model(registry, model_id)
    await registry.acquire(served)  # loads it if need be; held until the response ends
    if served.engine is None:  # unloaded by an admin just now
        raise APIError(503, f"model '{model_id}' was unloaded by an admin; retry",
                       code="model_stopped", headers={"Retry-After": "1"})  # fmt: skip
    has = getattr(served.engine, "task", "generate")
    if task is not None and has != task:
        route = {"embed": "/v1/embeddings", "rerank": "/v1/rerank"}.get(has, has)
        raise APIError(400, f"model '{model_id}' serves {route} (task: {has}), not generation",
                       param="model", code="model_not_supported")  # fmt: skip
    return served, served.engine


# On the 503 of a server shutting down: a front node (gateway/cluster/proxy.py)
# then sends the request to another node, which it may do for no other 503.
DRAINING_HEADER = "X-Specgate-Shutting-Down"


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or later",
                    code="shutting_down", headers={"Retry-After": "5", DRAINING_HEADER: "1"})  # fmt: skip


def check_stops(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """The request's stop strings, bounded in number and length (`param`
    names the field in each API: OpenAI's `stop`, Anthropic's `stop_sequences`)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"{param}: at most {MAX_STOP_STRINGS} stop strings", param=param)
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise APIError(
            400, f"{param}: each stop string is at most {MAX_STOP_LENGTH} characters", param=param
        )
    return [s for s in stops if s]


def _override(headers: Mapping[str, str]) -> tuple[str | None, int | None]:
    method = headers.get(METHOD_HEADER)
    depth_text = headers.get(DEPTH_HEADER)
    if method is not None:
        method = method.strip().lower()
        if method not in known_methods():
            raise APIError(
                400,
                f"X-Specgate-Method: unknown method '{method}'; one of "
                f"{', '.join(known_methods())}",
                param="X-Specgate-Method",
            )
    depth = None
    if depth_text is not None:
        try:
            depth = int(depth_text)
        except ValueError:
            depth = -1
        if not 0 <= depth <= 64:
            raise APIError(
                400, "X-Specgate-Depth: expected an integer 0..64", param="X-Specgate-Depth"
            )
    return method, depth


def plan_request(
    served: ServedModel,
    engine: Engine,
    headers: Mapping[str, str],
    prompt_tokens: list[int],
    sampling: SamplingParams,
    max_tokens: int | None,
    max_tokens_param: str = "max_tokens",
    ignore_eos: bool = False,
    prompt_param: str = "messages",
    prompt_text: str | None = None,
    boundaries: MessageBoundaries | None = None,
    default_max_tokens: int | None = None,
    images: tuple[ImageInput, ...] = (),
) -> Planned:
    """Check limits, decide the plan, and build the engine's request.
    Without `max_tokens`, `default_max_tokens` (an API's documented default)
    or else the model's configured one, either cut to what the context leaves.
    `prompt_text` (the rendered prompt, or its last message) classifies the
    content, whose acceptance the policy plans with; `boundaries` (a chat's)
    are where the prefix cache keeps snapshots; `images` the prompt's
    (serving/images.py)."""
    if prompt_text is not None and not isinstance(prompt_text, str):  # a message's parts
        prompt_text = "".join(p.get("text", "") for p in prompt_text if isinstance(p, dict))
    n_prompt = len(prompt_tokens)
    if n_prompt == 0:
        raise APIError(400, "the prompt is empty", param=prompt_param)
    room = engine.max_context - n_prompt
    if room < 1:
        # "prompt is too long": the words Anthropic's API uses, on which
        # Claude Code compacts its conversation.
        raise APIError(
            400,
            f"prompt is too long: {n_prompt} tokens > {engine.max_context - 1} maximum "
            f"(model '{served.id}' has a context of {engine.max_context} tokens, which must "
            "leave room for one generated token)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:  # the API's default, or the model's, never past the context
        max_tokens = min(room, default_max_tokens or served.config.default_max_tokens)
    elif max_tokens > room:
        # An upper bound, as llama-server and Ollama take it: what the context
        # leaves, ending as `length` if reached. Agents ask for their own
        # ceiling (Claude Code 32000) whatever the prompt; a 400 there ended
        # every turn once a conversation grew past context - 32000.
        log.debug("%s: %d tokens asked, %d left by the context of model '%s': at most %d",
                  max_tokens_param, max_tokens, room, served.id, room)  # fmt: skip
        max_tokens = room
    if ignore_eos and sampling.constraint is not None:
        raise APIError(400, f"ignore_eos: cannot be combined with {sampling.constraint.param}, "
                            "whose output ends where the grammar does", param="ignore_eos")
    method, depth = _override(headers)
    constrained = sampling.constraint is not None
    content = ("structured" if constrained else content_class(prompt_text) if prompt_text
               else "prose")  # fmt: skip
    features = RequestFeatures(n_prompt, sampling.has_penalties, method, depth, content,
                               constrained, max_tokens)  # fmt: skip
    try:
        plan, planner = served.policy.start(features, served.planning_state(arriving=True))
    except OverrideError as e:
        raise APIError(400, str(e), param="X-Specgate-Method") from None
    honoured = _honouring(served, plan, sampling)
    if honoured != plan:  # plain decoding, for a parameter speculation cannot apply
        plan, planner = honoured, FixedPlanner(honoured)
    record = access_log.current()
    request = GenerationRequest(
        # The access log's request id (X-Request-Id), which the engines' logs name too.
        request_id=record.generation_id() if record is not None else new_id("req"),
        model=served.id,
        prompt_tokens=prompt_tokens,
        sampling=sampling,
        max_tokens=max_tokens,
        plan=plan,
        stop_token_ids=frozenset() if ignore_eos else engine.eos_token_ids,
        **_cache_hints(served.cache_share, boundaries or MessageBoundaries()),
        images=images,
    )
    # A chat's reply (boundaries are a chat's) also ends at the model's own
    # reply stops, unless a grammar holds it.
    reply_stops = list(served.config.reply_stop) if boundaries is not None and not constrained else []
    return Planned(request, planner, content, served.policy, reply_stops)


def _cache_hints(share: str, boundaries: MessageBoundaries) -> dict:
    """The request's prefix-cache scope and snapshot points (engines/cache/prefix_cache.py).
    share: "system" lets keys share a system prompt's state, whole and
    nothing more; "none" keeps every key apart; "all" shares everything."""
    scope = "" if share == "all" else current_principal().name
    marks = tuple(b for b in (boundaries.system, boundaries.history) if b > 0)
    shared = boundaries.system if share == "system" else 0
    return {"cache_scope": scope, "boundaries": marks, "shared_prefix": shared}


@dataclass
class Planned:
    """A request ready to run: what the engine gets, and the policy's side."""

    request: GenerationRequest
    planner: Planner
    content: ContentClass  # whose acceptance its rounds teach
    policy: LivePolicy  # what its rounds teach (kept: an unload clears the model's)
    reply_stops: list[str] = field(default_factory=list)  # the model's: a natural end

    @property
    def plan(self) -> Plan:
        return self.request.plan


def _honouring(served: ServedModel, plan: Plan, sampling: SamplingParams) -> Plan:
    """The plan, or plain decoding when the planned engine cannot apply a
    sampling parameter exactly; a 400 naming it when nothing can."""
    refusal = served.engines[plan.engine].refusal(sampling)
    if refusal is None:
        return plan
    plain = served.policy.policy.engines_by_method.get(PLAIN)
    if plan.reason != "forced_by_request" and plain is not None and plain != plan.engine:
        if served.engines[plain].refusal(sampling) is None:
            return Plan(plain, PLAIN, 0, refusal.reason)
    raise APIError(400, f"model '{served.id}' ({plan.engine}) cannot serve this request exactly: "
                        f"{refusal.message}", param=refusal.param, code="unsupported_parameter")


def plan_headers(plan: Plan) -> dict[str, str]:
    return {PLAN_HEADER: plan.header()}


QUEUE_TIMEOUT_RETRY_S = 5


async def admit(served: ServedModel, principal: Principal, metrics: Metrics,
                 request_id: str | None = None) -> None:  # fmt: skip
    """Wait for a decoding slot on the model, or raise APIError: 429 when the
    key is over a quota or the model's queue is full, 503 after the longest
    wait. Once this returns, the caller owns a slot and one of the key's
    streams, and must give both back."""
    gate, key, now = served.gate, principal.name, time.monotonic()

    def busy() -> APIError:
        metrics.rejected(key, "queue_full")
        return APIError(
            429, f"model '{served.id}' is busy: {gate.running} requests decoding and "
                 f"{gate.waiting} waiting (limit {gate.max_queue})",
            code="overloaded", headers={"Retry-After": "1"},
        )

    def closing() -> APIError:
        metrics.rejected(key, "shutting_down")
        return shutting_down()

    try:
        principal.usage.check(now)
        place = gate.reserve(key, request_id)  # who waits: the admin page shows it
    except GateClosed:
        raise closing() from None
    except Rejected as e:
        metrics.rejected(key, e.reason)
        raise APIError(429, e.message, code="rate_limit_exceeded",
                       headers={"Retry-After": e.retry_after_header}) from None
    except QueueFull:
        raise busy() from None
    principal.usage.start(now)
    if place is None:
        metrics.queued(served.id, 0.0)
        return
    try:
        await gate.wait(key, place)
    except GateClosed:
        principal.usage.finish()
        raise closing() from None
    except QueueFull:  # its place went to another key's request
        principal.usage.finish()
        raise busy() from None
    except QueueTimeout:
        principal.usage.finish()
        metrics.rejected(key, "queue_timeout")
        raise APIError(
            503, f"model '{served.id}' is busy: no slot within {gate.max_wait:g} s",
            code="queue_timeout", headers={"Retry-After": str(QUEUE_TIMEOUT_RETRY_S)},
        ) from None
    except BaseException:  # cancelled: the client left while waiting
        principal.usage.finish()
        raise
    metrics.queued(served.id, time.monotonic() - now)


async def run(
    served: ServedModel,
    planned: Planned,
    stops: list[str],
    usage: Usage,
    metrics: Metrics,
) -> AsyncIterator[Piece]:
    """Stream a request as sendable pieces; closing this iterator cancels it.
    It first waits its turn in the model's admission queue (fair across
    keys); an adapter awaiting the first piece sees quota and queue refusals
    as APIError before any byte is sent."""
    request, planner = planned.request, planned.planner
    matcher = StopMatcher(stops + [s for s in planned.reply_stops if s not in stops])
    principal = current_principal()
    key = principal.name
    start, ttft, status = time.perf_counter(), None, "cancelled"
    metrics.planned(request.model, request.plan)
    record = access_log.current() or access_log.AccessRecord("", start)  # (none: a test's direct call)
    record.model = served.id
    record.planned(request.plan.method)
    record.prompt_tokens += usage.prompt_tokens
    method, last_token_at = request.plan.method, None
    admitted = False
    try:
        try:
            await admit(served, principal, metrics, request.request_id)
        except APIError:
            status = "rejected"
            raise
        admitted = True
        answering(served, False)  # (a request's second generation on the model)
        live = metrics.live.begin(request.request_id, served.id, key, method, usage.prompt_tokens)
        work = served.gate.work  # the fair queue's measure: tokens this key had processed
        work.charge(key, usage.prompt_tokens)
        principal.usage.count_tokens(time.monotonic(), usage.prompt_tokens)
        metrics.key_prompt_tokens(key, usage.prompt_tokens)

        def from_cache(tokens: int) -> None:
            # The engine's lookup served `tokens` of the prompt (its first
            # PrefillProgress or first TokenEvent says so): counted once.
            if tokens and not usage.cached_tokens:
                work.charge(key, -tokens)
                record.cached_tokens += tokens
                usage.cached_tokens = tokens

        first = served.engines.get(request.plan.engine)
        if first is None:  # unloaded by an admin while this request waited
            raise APIError(503, f"model '{served.id}' was unloaded by an admin",
                           code="model_stopped")  # fmt: skip
        # An engine at its own limit raises at once.
        events = first.generate(request, planner)
        while events is not None:
            handoff = None
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, Handoff):
                        handoff = event
                        break
                    if isinstance(event, RoundStats):
                        metrics.round(event)
                        planned.policy.observe(event, planned.content)
                        continue
                    if isinstance(event, PrefillProgress):
                        usage.prefill = event
                        from_cache(event.cached)
                        continue
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    if event.token_ids:
                        gap = None if last_token_at is None else now - last_token_at
                        metrics.tokens(request.model, method, len(event.token_ids), gap, key)
                        principal.usage.count_tokens(time.monotonic(), len(event.token_ids))
                        record.tokens(len(event.token_ids), now)
                        last_token_at = now
                    usage.completion_tokens += len(event.token_ids)
                    live.generated = usage.completion_tokens
                    from_cache(event.cached_tokens)
                    work.charge(key, len(event.token_ids))
                    text = matcher.feed(event.text)
                    if matcher.stopped:
                        status = "ok"
                        # A reply stop of the model's is its end of turn, as EOS is.
                        matched = matcher.matched if matcher.matched in stops else None
                        yield Piece(text, event.token_ids, event.logprobs, "stop", matched)
                        return
                    if event.finish_reason is not None:
                        text += matcher.flush()
                        status = "ok"
                    if text or event.token_ids or event.finish_reason:
                        yield Piece(text, event.token_ids, event.logprobs, event.finish_reason)
            events = None
            if handoff is not None:  # the stream continues on another engine
                metrics.planned(request.model, handoff.plan)
                method = live.method = handoff.plan.method
                record.planned(method)
                engine = served.engines[handoff.plan.engine]
                events = engine.generate(request, planner, resume=handoff)
    except EngineOverloaded as e:
        status = "rejected"
        raise APIError(
            429,
            str(e),
            code="overloaded",
            headers={"Retry-After": str(max(1, round(e.retry_after)))},
        ) from None
    except EngineStopped:
        status = "error"
        if served.gate.closed:
            raise shutting_down() from None
        raise APIError(503, f"model '{served.id}' was stopped (unloaded by an admin) while "
                            "generating", code="model_stopped") from None  # fmt: skip
    except EngineError as e:
        status = "error"
        raise APIError(500, f"generation failed: {e}", code="engine_error") from None
    finally:
        record.generation_ended(status)
        if admitted:
            served.gate.release()
            answering(served, True)
            principal.usage.finish()
            metrics.live.end(request.request_id)
        metrics.finished(
            request.model, request.plan, status, usage.prompt_tokens, ttft,
            time.perf_counter() - start, key,
        )
