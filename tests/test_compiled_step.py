"""The lone loop's compiled forward (engines/forwards/compiled.py) gives plain
greedy decoding's tokens, across its buffers' growth, and hands back caches
that decode on exactly.

The model is a tiny dense qwen3 checkpoint (builders/tiny.py, every cache a
KVCache, float32), so the compiled path applies; each output is compared
with mlx-lm's `generate_step` token for token.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models.cache import make_prompt_cache

from specgate.builders.tiny import build_qwen3_dense
from specgate.engines.base import CacheSettings, GenerationRequest, Plan, SamplingParams, TokenEvent
from specgate.engines.forwards.compiled import STEP, CompiledDecode, CompiledForward, fits
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_plain.engine import MLXPlainEngine

GREEDY = SamplingParams(temperature=0.0)
PLAN = Plan("mlx_plain", "none", 0, "concurrency")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = build_qwen3_dense(tmp_path_factory.mktemp("dense") / "qwen3", seed=0)
    loaded = load_mlx_model(str(path), CacheSettings(disk_bytes=0))
    loaded.model.set_dtype(mx.float32)
    return loaded


def prompt_of(n: int, vocab: int) -> list[int]:
    return [(i * 37 + 11) % vocab for i in range(n)]


def test_compiled_decode_is_generate_step_across_buffer_growth(loaded):
    model, vocab = loaded.model, loaded.vocab_size
    prompt = prompt_of(200, vocab)  # 200 + 90 rows: the buffers grow past 256 on the way
    want, margins = greedy_reference(model, prompt, 110)
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1, :], axis=-1)
    assert fits(cache)
    decode = CompiledDecode(CompiledForward(model), cache)
    got = []
    for _ in range(90):
        got.append(y.item())
        y = mx.argmax(decode(y), axis=-1)
    assert decode.keys[0].shape[2] == 2 * STEP
    # Back to mlx-lm's caches: the uncompiled forward carries on from them.
    cache = decode.caches()
    assert [c.offset for c in cache] == [len(prompt) + 90] * len(cache)
    for _ in range(20):
        got.append(y.item())
        y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
    assert_same_greedy(got, want, margins)


def test_a_cache_the_compiled_forward_cannot_take_is_refused(loaded):
    from mlx_lm.models.cache import RotatingKVCache

    cache = make_prompt_cache(loaded.model)
    assert not fits(cache)  # empty: no buffers to take the shapes from
    loaded.model(mx.array([[1, 2, 3]]), cache=cache)
    assert fits(cache)
    assert not fits([*cache[:-1], RotatingKVCache(max_size=64)])


def run(loaded, body):
    async def main():
        engine = MLXPlainEngine("dense", loaded, max_context=2048, compiled=True,
                                prefix_cache_size=0)  # fmt: skip
        await engine.start()
        try:
            return await body(engine), engine
        finally:
            await engine.stop()

    return asyncio.run(asyncio.wait_for(main(), 120))


async def collect(engine, rid, prompt, n, started=None, after=0):
    req = GenerationRequest(rid, "dense", prompt, GREEDY, n, PLAN, cache_scope=rid)
    tokens = []
    async for event in engine.generate(req):
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
            if started is not None and len(tokens) >= after:
                started.set()
    return tokens


def test_the_engine_decodes_alone_compiled_and_joins_the_batch_exactly(loaded):
    vocab = loaded.vocab_size
    a, b = prompt_of(30, vocab), prompt_of(12, vocab)[::-1]

    async def body(engine):
        started = asyncio.Event()
        first = asyncio.create_task(collect(engine, "a", a, 300, started, 20))
        await started.wait()
        second = await collect(engine, "b", b, 25)
        return await first, second

    (got_a, got_b), engine = run(loaded, body)
    for got, prompt, n in ((got_a, a, 300), (got_b, b, 25)):
        want, margins = greedy_reference(loaded.model, prompt, n)
        assert_same_greedy(got, want, margins)
    # A decoded compiled, joined B's batch, and went on compiled after B left.
    assert engine.compiled_tokens == engine.lone_tokens > 250, engine.compiled_tokens
