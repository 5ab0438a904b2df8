"""/v1/embeddings (OpenAI), /v1/rerank (Jina and Cohere's shape), and
Ollama's /api/embed and /api/embeddings, over one model's Embedder.

A model answers embeddings when its task is embed and rerank when it is
rerank (gateway/config.py: `task`); any other asks gets a 400 saying so. A
client that leaves stops its work at the next forward (until_disconnect).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Awaitable, Callable

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from specgate.engines.cpu import run_cpu
from specgate.engines.embedding import rerank
from specgate.gateway.api.chat import ClientGone, until_disconnect
from specgate.gateway.api.ollama_api import JsonBodies, ollama_model_id
from specgate.gateway.api.retrieval.schema import (
    EmbeddingRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    RerankRequest,
)
from specgate.gateway.errors import APIError
from specgate.gateway.serving.generation import new_id, resolve_model
from specgate.gateway.serving.vectors import (
    bounded,
    check_dimensions,
    embedder_of,
    encode_all,
    run_vectors,
)

router = APIRouter()
# Ollama's routes read every body as JSON, whatever its Content-Type (ollama_api.py).
ollama_router = APIRouter(route_class=JsonBodies)


async def _vectors(request: Request, model: str, texts_or_ids: list, dimensions: int | None,
                   *, param: str, truncate: bool = False) -> tuple[np.ndarray, int] | Response:  # fmt: skip
    """(vectors, tokens) of each input, or the 499 of a client gone."""
    served, engine = await resolve_model(request.app.state.registry, model, task=None)
    embedder = embedder_of(served, engine, "embed", "embeddings")
    check_dimensions(served, embedder, dimensions)
    if texts_or_ids and isinstance(texts_or_ids[0], str):
        inputs = await encode_all(engine, texts_or_ids)
    else:
        inputs = [list(ids) for ids in texts_or_ids]
    inputs = bounded(inputs, engine.max_context, engine.vocab_size, param=param, truncate=truncate)
    return await _computed(request, served, "embed", inputs, lambda: embedder.embed(inputs, dimensions))


async def _computed(request: Request, served, kind: str, inputs: list[list[int]],
                    work: Callable[[], Awaitable]) -> tuple[object, int] | Response:  # fmt: skip
    """(what `work()` computed, the inputs' tokens), run as the model's
    `kind` request (serving/vectors.run_vectors); the 499 of a client that
    left meanwhile, its work cancelled."""
    tokens = sum(map(len, inputs))
    try:
        done = await until_disconnect(request, run_vectors(
            served, kind, tokens, len(inputs), request.app.state.metrics, work))  # fmt: skip
    except ClientGone:
        return Response(status_code=499)
    return done, tokens


async def _json(make: Callable[[], dict]) -> Response:
    """The answer made and encoded on the CPU workers: 2,048 vectors of
    4,096 floats are 150 MB of JSON, which would hold the event loop for
    seconds."""
    body = await run_cpu(lambda: json.dumps(make(), separators=(",", ":")).encode())
    return Response(body, media_type="application/json")


def _base64(vector: np.ndarray) -> str:
    """As OpenAI sends `encoding_format: base64`: little-endian float32 bytes."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    got = await _vectors(request, body.model, body.items(), body.dimensions, param="input")
    if isinstance(got, Response):
        return got
    vectors, tokens = got
    encode = _base64 if body.encoding_format == "base64" else np.ndarray.tolist
    return await _json(lambda: {
        "object": "list", "model": body.model,
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


@router.post("/v1/rerank")
@router.post("/rerank", include_in_schema=False)
async def rerank_documents(body: RerankRequest, request: Request):
    served, engine = await resolve_model(request.app.state.registry, body.model, task=None)
    embedder = embedder_of(served, engine, "rerank", "rerank")
    texts = body.texts()
    try:
        answers = await run_cpu(rerank.answers, engine.tokenizer)
    except ValueError as e:  # a vocabulary without one-token answers
        raise APIError(400, f"model '{served.id}' cannot rerank: {e}", param="model",
                       code="model_not_supported") from None  # fmt: skip
    instruction = engine.embedding.instruction or rerank.DEFAULT_INSTRUCTION
    prompts = await run_cpu(rerank.prompts, engine.tokenizer, instruction, body.query, texts,
                            body.max_tokens_per_doc)  # fmt: skip
    prompts = bounded(prompts, engine.max_context, engine.vocab_size, param="documents")
    got = await _computed(request, served, "rerank", prompts, lambda: embedder.score(prompts, answers))
    if isinstance(got, Response):
        return got
    scores, tokens = got
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or len(scores)]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": new_id("rerank"), "model": body.model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


# -- Ollama's shapes (errors in Ollama's {"error": ...}: gateway/errors.py picks by path) ----


@ollama_router.post("/api/embed", include_in_schema=False)
async def ollama_embed(body: OllamaEmbedRequest, request: Request):
    start = time.perf_counter()
    got = await _vectors(request, ollama_model_id(request, body.model), body.items(), body.dimensions,
                         param="input", truncate=body.truncate)  # fmt: skip
    if isinstance(got, Response):
        return got
    vectors, tokens = got
    took = int((time.perf_counter() - start) * 1e9)
    return await _json(lambda: {"model": body.model, "embeddings": vectors.tolist(),
                                "total_duration": took, "load_duration": 0,
                                "prompt_eval_count": tokens})  # fmt: skip


@ollama_router.post("/api/embeddings", include_in_schema=False)
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request):
    model = ollama_model_id(request, body.model)
    if not body.prompt:  # Ollama answers an empty prompt with an empty vector
        await resolve_model(request.app.state.registry, model, task=None)
        return {"embedding": []}
    got = await _vectors(request, model, [body.prompt], None, param="prompt", truncate=True)
    if isinstance(got, Response):
        return got
    return {"embedding": got[0][0].tolist()}
