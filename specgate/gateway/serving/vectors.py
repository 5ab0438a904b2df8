"""Running an embeddings or rerank request, API-neutral: its inputs tokenized
and bounded, its turn in the model's admission queue, its quota, usage,
metrics and access-log fields, as generation.run does for a generation.
The work itself is the model's Embedder's (engines/embedding/).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from specgate.engines.base import EngineError, EngineOverloaded, EngineStopped
from specgate.engines.cpu import run_cpu
from specgate.gateway.access import access_log
from specgate.gateway.access.auth import current_principal
from specgate.gateway.errors import APIError
from specgate.gateway.serving.generation import admit, shutting_down
from specgate.gateway.serving.metrics import Metrics
from specgate.gateway.serving.models import ServedModel

T = TypeVar("T")

# Tokens of all of a request's inputs together (OpenAI's limit for /v1/embeddings).
MAX_TOTAL_TOKENS = 300_000


def embedder_of(served: ServedModel, engine, task: str, route: str):
    """The model's Embedder for `task` ("embed" or "rerank"), or a 400 that
    says why this model answers no such request."""
    has = getattr(engine, "task", "generate")
    if not hasattr(engine, "embedder"):
        raise APIError(400, f"model '{served.id}' runs on llama-server, which specgate does not "
                            f"ask for {route}; serve an MLX checkpoint with task: {task}",
                       param="model", code="model_not_supported")  # fmt: skip
    if has != task:
        raise APIError(400, f"model '{served.id}' is served for {has} (its task), not {route}; "
                            f"set `task: {task}` on a model made for it",
                       param="model", code="model_not_supported")  # fmt: skip
    if engine.loaded.lockstep is not None:
        raise APIError(400, f"model '{served.id}' runs over several ranks; {route} are served on "
                            "one machine", param="model", code="model_not_supported")  # fmt: skip
    return engine.embedder()


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    return [list(tokenizer.encode(t)) for t in texts]


async def encode_all(engine, texts: list[str]) -> list[list[int]]:
    """Every text's tokens, in one job on the bounded CPU workers."""
    return await run_cpu(_encode_all, engine.tokenizer, texts)


def bounded(inputs: list[list[int]], context: int, vocab: int, *, param: str,
            truncate: bool = False) -> list[list[int]]:  # fmt: skip
    """Each input within the model's context (cut to it where the client
    asked for that, as Ollama's `truncate` does; else a 400 naming it), its
    ids within the vocabulary, and all of them within MAX_TOTAL_TOKENS."""
    out = []
    for i, ids in enumerate(inputs):
        if not ids:
            raise APIError(400, f"{param}[{i}]: encodes to no tokens", param=param)
        if len(ids) > context:
            if not truncate:
                raise APIError(400, f"{param}[{i}]: {len(ids)} tokens, more than the model's "
                                    f"context of {context}", param=param,
                               code="context_length_exceeded")  # fmt: skip
            ids = ids[:context]
        if max(ids) >= vocab:
            raise APIError(400, f"{param}[{i}]: token id {max(ids)} is outside the vocabulary "
                                f"(size {vocab})", param=param)  # fmt: skip
        out.append(ids)
    total = sum(map(len, out))
    if total > MAX_TOTAL_TOKENS:
        raise APIError(400, f"{param}: {total} tokens in all, more than {MAX_TOTAL_TOKENS} a "
                            "request; send them in several", param=param)  # fmt: skip
    return out


def check_dimensions(served: ServedModel, embedder, dimensions: int | None) -> None:
    if dimensions is None:
        return
    size = embedder.loaded.text_config.get("hidden_size")
    if not embedder.pooling.allows(dimensions):
        raise APIError(400, f"dimensions: model '{served.id}' makes vectors of one size"
                            f"{f' ({size})' if size else ''}; it was not trained to be cut "
                            "(set `embedding: {matryoshka: true}` for one that was)",
                       param="dimensions")  # fmt: skip
    if size and dimensions > size:
        raise APIError(400, f"dimensions: at most {size} for model '{served.id}'",
                       param="dimensions")  # fmt: skip


async def run_vectors(served: ServedModel, kind: str, tokens: int, inputs: int,
                      metrics: Metrics, work: Callable[[], Awaitable[T]]) -> T:  # fmt: skip
    """`work()` once admitted on the model (its slot, the key's quota), with
    its usage counted and its outcome in the metrics and the access log."""
    principal = current_principal()
    key, start, status = principal.name, time.perf_counter(), "cancelled"
    record = access_log.current() or access_log.AccessRecord("", start)
    record.model = served.id
    record.planned(kind)
    record.prompt_tokens += tokens
    admitted = False
    try:
        try:
            await admit(served, principal, metrics)
        except APIError:
            status = "rejected"
            raise
        admitted = True
        served.gate.work.charge(key, tokens)
        principal.usage.count_tokens(time.monotonic(), tokens)
        metrics.key_prompt_tokens(key, tokens)
        result = await work()
        status = "ok"
        return result
    except EngineOverloaded as e:
        status = "rejected"
        raise APIError(429, str(e), code="overloaded",
                       headers={"Retry-After": str(max(1, round(e.retry_after)))}) from None  # fmt: skip
    except EngineStopped:
        status = "error"
        if served.gate.closed:
            raise shutting_down() from None
        raise APIError(503, f"model '{served.id}' was stopped (unloaded by an admin) while "
                            f"computing {kind}", code="model_stopped") from None  # fmt: skip
    except EngineError as e:
        status = "error"
        raise APIError(500, f"{kind} failed: {e}", code="engine_error") from None
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        record.generations += 1
        record.generation_ended(status)
        if admitted:
            served.gate.release()
            principal.usage.finish()
        metrics.vectors_finished(served.id, kind, status, tokens, inputs,
                                 time.perf_counter() - start, key)  # fmt: skip
