"""The embedding worker (engines/embedding/embedder.py) directly: a request
whose client left stops at its next forward, and requests take turns,
forward by forward, so a large one does not hold up a small one. The
model's lock is held by the test to stop the worker at a known point (the
lock every engine of the model takes around its MLX work)."""

from __future__ import annotations

import asyncio
import time

import pytest

from specgate.builders.embedding import build_qwen3_embedding
from specgate.engines.embedding.embedder import Embedder
from specgate.engines.embedding.pooling import Pooling
from specgate.engines.loading import load_mlx_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_mlx_model(str(build_qwen3_embedding(tmp_path_factory.mktemp("emb") / "m", seed=4)))


async def _worker_waits_for_the_lock(loaded) -> None:
    deadline = time.monotonic() + 30
    while not loaded.lock._waiters:  # the worker, at its forward's `with lock`
        assert time.monotonic() < deadline, "the worker never reached its forward"
        await asyncio.sleep(0.01)


def test_a_cancelled_request_stops_at_its_next_forward(loaded):
    async def main():
        embedder = Embedder("m", loaded, Pooling(), max_batch_tokens=8)
        inputs = [[5, 6, 7, 8, 9, 10, 11, 12]] * 10  # one input a forward: ten forwards
        loaded.lock.acquire()
        task = asyncio.ensure_future(embedder.embed(inputs))
        try:
            await _worker_waits_for_the_lock(loaded)
            task.cancel()
            # The task takes its cancel (marks its job) before the lock goes:
            # released first, a loaded loop let the worker run 8 forwards (ci35).
            await asyncio.sleep(0)
        finally:
            loaded.lock.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = await embedder.embed([[1, 2, 3]])  # the worker goes on serving
        await embedder.stop()
        return embedder.forwards, done

    forwards, done = asyncio.run(main())
    assert forwards == 2, forwards  # the one under way when it was cancelled, then the next request's
    assert done.shape[0] == 1


def test_requests_take_turns_forward_by_forward(loaded):
    async def main():
        embedder = Embedder("m", loaded, Pooling(), max_batch_tokens=8)
        big = [[5, 6, 7, 8, 9, 10, 11, 12]] * 10
        loaded.lock.acquire()
        try:
            a = asyncio.ensure_future(embedder.embed(big))
            await _worker_waits_for_the_lock(loaded)
            b = asyncio.ensure_future(embedder.embed([[3, 4]]))
            await asyncio.sleep(0.05)  # b is in the worker's inbox
        finally:
            loaded.lock.release()
        await b
        a_done_when_b_was = a.done()
        whole = await a
        await embedder.stop()
        return a_done_when_b_was, embedder.forwards, whole

    a_done_when_b_was, forwards, whole = asyncio.run(main())
    assert not a_done_when_b_was
    assert forwards == 11 and whole.shape[0] == 10


def test_a_module_specgate_does_not_apply_is_refused_by_name(tmp_path):
    import json

    from specgate.engines.embedding.pooling import PoolingError

    path = build_qwen3_embedding(tmp_path / "dense", seed=5)
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingError, match="models.Dense"):
        load_mlx_model(str(path))


def test_the_config_types_task_and_embedding_settings(tmp_path):
    from specgate.gateway.config import ConfigError, json_schema, parse_config

    def model(**fields):
        return parse_config({"models": [{"id": "m", "path": "builtin:demo", **fields}]}).models[0]

    assert model(task="embed").engines == ["mlx_plain"]
    with pytest.raises(ConfigError, match="mlx_plain alone"):
        model(task="rerank", engines=["mlx_plain", "mlx_mtp"])
    with pytest.raises(ConfigError, match="task embed or rerank"):
        model(task="generate", embedding={"pooling": "mean"})
    with pytest.raises(ConfigError, match="pooling"):
        model(task="embed", embedding={"pooling": "max"})
    with pytest.raises(ConfigError, match="keeps no KV cache"):
        model(task="embed", kv_bits=8)
    fields = json_schema()["$defs"]["ModelConfig"]["properties"]
    assert {"task", "embedding"} <= set(fields)


def test_an_embedding_model_reserves_one_forward_not_a_kv_cache():
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving.footprint import estimate

    def reserve(**fields) -> int:
        mc = parse_config({"models": [{"id": "m", "path": "builtin:demo", "max_context": 4096,
                                       **fields}]}).models[0]  # fmt: skip
        return estimate(mc).kv_reserve

    generate = reserve()
    embed = reserve(task="embed", embedding={"max_batch_tokens": 1024})
    assert 0 < embed < generate / 8  # 1k tokens against 8 x 4k


def test_a_real_model_s_vectors_place_a_paraphrase_nearer_than_another_topic(smollm2_gguf):
    """SmolLM2-135M-Instruct (a real pretrained chat model, as `task: embed`
    serves any decoder): last-token vectors of a batch equal each text's
    forward alone, and a paraphrase is nearer than a sentence on another topic."""
    import numpy as np

    from specgate.engines.embedding.pooling import configured

    loaded = load_mlx_model(str(smollm2_gguf))
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.",
             "Stock markets fell sharply today after the bank raised rates."]  # fmt: skip
    ids = [loaded.tokenizer.encode(t) for t in texts]

    async def main():
        embedder = Embedder("smollm2", loaded, configured(None, loaded.text_config))
        together = await embedder.embed(ids)
        alone = [await embedder.embed([i]) for i in ids]
        await embedder.stop()
        return together, alone

    together, alone = asyncio.run(main())
    for row, single in zip(together, alone, strict=True):
        np.testing.assert_allclose(row, single[0], atol=1e-4)
    similarity = together @ together.T
    assert similarity[0, 1] > similarity[0, 2] + 0.05, similarity
