"""Embeddings and rerank through a real gateway (issue 46): /v1/embeddings
from the official `openai` SDK, Ollama's /api/embed from the `ollama` SDK,
/v1/rerank in Jina/Cohere's shape, on tiny checkpoints in Qwen3-Embedding's
and Qwen3-Reranker's published layouts (specgate/builders/embedding.py).

Every vector and score is held against a forward of the checkpoint made
here without specgate's loader: mlx-lm's qwen3 model built from config.json
with the tensors renamed by hand, and the checkpoint's tokenizer.json read
by `tokenizers` (whose post-processor appends <|endoftext|>).
"""

from __future__ import annotations

import json
import math

import httpx
import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest
from conftest import start_gateway, stop_gateway
from tokenizers import Tokenizer

from specgate.builders.embedding import build_qwen3_embedding, build_qwen3_reranker
from specgate.engines.embedding import rerank

CONTEXT = 64
TEXTS = ["hello world", "the sea and the ships upon it, far away", "x", "def f(a):\n    return a"]


def direct_model(path):
    """mlx-lm's qwen3 from the checkpoint's files, tensors named by hand."""
    from mlx_lm.models import qwen3

    config = json.loads((path / "config.json").read_text())
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = mx.load(str(path / "model.safetensors"))
    model.load_weights([(k if k.startswith("model.") else f"model.{k}", v) for k, v in weights.items()])
    return model, Tokenizer.from_file(str(path / "tokenizer.json"))


def direct_vector(model, ids: list[int], mode: str, normalize: bool) -> np.ndarray:
    hidden = np.array(model.model(mx.array([ids]))[0].astype(mx.float32))
    v = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[mode]
    return v / np.linalg.norm(v) if normalize else v


def marked_reranker(path, marker: int, answers: rerank.Answers) -> None:
    """Weight surgery, so a known example has a known order:
    the only signal reaching the last position is how often `marker` occurs
    in the prompt (layer 0 attends uniformly, q = 0, and copies one feature
    of the embedding that only the marker has; nothing else writes it), and
    the tied head reads that feature as "yes" against "no"."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(path / "model.safetensors"))
    emb = t["model.embed_tokens.weight"]
    f = 0  # the feature
    emb[:, f] = 0.0
    emb[marker, f] = 40.0
    emb[answers.yes] = 0.0
    emb[answers.no] = 0.0
    emb[answers.yes, f], emb[answers.no, f] = 1.0, -1.0
    for name in list(t):
        if ".mlp.down_proj" in name or (".o_proj" in name and not name.startswith("model.layers.0.")):
            t[name][:] = 0.0
    t["model.layers.0.self_attn.q_proj.weight"][:] = 0.0
    v, o = t["model.layers.0.self_attn.v_proj.weight"], t["model.layers.0.self_attn.o_proj.weight"]
    v[:] = 0.0
    o[:] = 0.0
    v[0, f] = 1.0  # kv head 0, dim 0 <- the feature (after the input norm's gain)
    o[f, 0] = 1.0  # query head 0, dim 0 -> the feature
    t["model.layers.0.input_layernorm.weight"][:] = 1.0
    t["model.norm.weight"][f] = 1.0
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding-models")
    last = build_qwen3_embedding(root / "qwen3-embedding", seed=1)
    mean = build_qwen3_embedding(root / "mean-embedding", seed=2, pooling="mean_tokens",
                                 normalize=False)  # fmt: skip
    rr = build_qwen3_reranker(root / "qwen3-reranker", seed=3)
    tok = Tokenizer.from_file(str(rr / "tokenizer.json"))
    answers = rerank.Answers(tok.token_to_id("yes"), tok.token_to_id("no"))
    marker = tok.encode(" @", add_special_tokens=False).ids  # as each document writes it
    assert len(marker) == 1 and None not in answers.__dict__.values()
    marked_reranker(rr, marker[0], answers)
    return {"last": last, "mean": mean, "rerank": rr}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    gw = start_gateway(
        {"server": {"max_body_bytes": "256KiB"},
         "models": [
             {"id": "emb", "path": str(checkpoints["last"]), "max_context": CONTEXT},
             {"id": "emb-mrl", "path": str(checkpoints["last"]), "max_context": CONTEXT,
              "embedding": {"matryoshka": True, "max_batch_tokens": 16}},
             {"id": "emb-mean", "path": str(checkpoints["mean"])},
             {"id": "rr", "path": str(checkpoints["rerank"]), "task": "rerank"},
             {"id": "gen", "path": str(checkpoints["rerank"])},
             # A vocabulary that writes "yes" in two tokens cannot be scored.
             {"id": "rr-two-token-yes", "path": str(checkpoints["mean"]), "task": "rerank"},
         ]},
        tmp_path_factory.mktemp("embeddings-gateway"),
    )  # fmt: skip
    yield gw
    stop_gateway(gw)


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def test_openai_sdk_vectors_equal_a_direct_forward(server, checkpoints):
    model, tok = direct_model(checkpoints["last"])
    ids = [tok.encode(t).ids for t in TEXTS]
    assert all(i[-1] == tok.token_to_id("<|endoftext|>") for i in ids)
    want = [direct_vector(model, i, "last", True) for i in ids]
    client = sdk(server)
    # The SDK asks for base64 unless told (and decodes it); then floats.
    for fmt in (openai.NOT_GIVEN, "float"):
        got = client.embeddings.create(model="emb", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in got.data] == list(range(len(TEXTS)))
        assert got.usage.prompt_tokens == sum(map(len, ids))
        for d, w in zip(got.data, want, strict=True):
            np.testing.assert_allclose(d.embedding, w, atol=2e-5)
    # Token ids as OpenAI takes them: one list, or a list of lists.
    one = client.embeddings.create(model="emb", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=2e-5)
    # Batched in forwards of 16 padded tokens: the same vectors.
    small = client.embeddings.create(model="emb-mrl", input=TEXTS, encoding_format="float")
    for d, w in zip(small.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, atol=2e-5)


def test_mean_pooling_without_normalize_as_the_checkpoint_declares(server, checkpoints):
    model, tok = direct_model(checkpoints["mean"])
    got = sdk(server).embeddings.create(model="emb-mean", input=TEXTS, encoding_format="float")
    for d, text in zip(got.data, TEXTS, strict=True):
        want = direct_vector(model, tok.encode(text).ids, "mean", False)
        np.testing.assert_allclose(d.embedding, want, atol=2e-5)
    assert abs(np.linalg.norm(got.data[1].embedding) - 1) > 1e-3  # not normalized


def test_dimensions_cut_a_matryoshka_model_and_are_refused_elsewhere(server, checkpoints):
    model, tok = direct_model(checkpoints["last"])
    client = sdk(server)
    full = direct_vector(model, tok.encode(TEXTS[0]).ids, "last", False)
    got = client.embeddings.create(model="emb-mrl", input=TEXTS[0], dimensions=16,
                                   encoding_format="float")  # fmt: skip
    np.testing.assert_allclose(got.data[0].embedding, full[:16] / np.linalg.norm(full[:16]), atol=2e-5)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="emb", input="x", dimensions=16)
    assert "dimensions" in e.value.message and "matryoshka" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="emb-mrl", input="x", dimensions=65)
    assert "at most 64" in e.value.message


def test_oversized_input_is_refused_and_the_server_keeps_serving(server):
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="emb", input=["ok", "word " * 200])
    assert e.value.code == "context_length_exceeded" and "input[1]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="emb", input=["a"] * 2049)
    assert "at most 2048" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="emb", input=[[5, 999999]])
    assert "outside the vocabulary" in e.value.message
    r = httpx.post(server.api + "/embeddings", json={"model": "emb", "input": "z" * 300_000}, timeout=30)
    assert r.status_code == 413, r.text
    r = httpx.post(server.api + "/rerank", json={"model": "rr", "query": "q",
                                                 "documents": ["word " * 9000]}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "documents[0]" in r.json()["error"]["message"], r.text
    assert len(client.embeddings.create(model="emb", input="still here").data) == 1


def test_rerank_orders_a_known_example_and_scores_equal_a_direct_forward(server, checkpoints):
    model, tok = direct_model(checkpoints["rerank"])
    query = "which line has the most at signs"
    documents = ["one @ here", "none here", "@ @ @ three", {"text": "two @ and @"}]
    r = httpx.post(server.api + "/rerank", json={"model": "rr", "query": query,
                                                 "documents": documents}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [2, 3, 0, 1]
    assert results[1]["document"] == {"text": "two @ and @"}
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    for x in results:
        text = documents[x["index"]]
        text = text if isinstance(text, str) else text["text"]
        prompt = (tok.encode(rerank.HEAD, add_special_tokens=False).ids
                  + tok.encode(rerank.middle(rerank.DEFAULT_INSTRUCTION, query, text),
                               add_special_tokens=False).ids
                  + tok.encode(rerank.TAIL, add_special_tokens=False).ids)  # fmt: skip
        h = model.model(mx.array([prompt]))[:, -1]
        logits = np.array(model.model.embed_tokens.as_linear(h)[0].astype(mx.float32))
        want = 1 / (1 + math.exp(logits[no] - logits[yes]))
        assert x["relevance_score"] == pytest.approx(want, abs=1e-5)
    top = httpx.post(server.api + "/rerank", json={"model": "rr", "query": query, "top_n": 2,
                                                   "documents": documents,
                                                   "return_documents": False}, timeout=60).json()  # fmt: skip
    assert [x["index"] for x in top["results"]] == [2, 3] and "document" not in top["results"][0]
    assert top["usage"]["total_tokens"] > 0


def test_ollama_sdk_embed_and_embeddings(server):
    client = ollama.Client(host=server.base_url, timeout=60)
    want = sdk(server).embeddings.create(model="emb", input=TEXTS[:2], encoding_format="float")
    got = client.embed(model="emb:latest", input=TEXTS[:2])
    for v, w in zip(got.embeddings, want.data, strict=True):
        np.testing.assert_allclose(v, w.embedding, atol=1e-6)
    assert got.prompt_eval_count == want.usage.prompt_tokens
    long = "word " * 200
    assert len(client.embed(model="emb", input=long).embeddings) == 1  # Ollama truncates by default
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="emb", input=long, truncate=False)
    assert e.value.status_code == 400 and "context" in e.value.error
    legacy = client.embeddings(model="emb", prompt=TEXTS[0])
    np.testing.assert_allclose(legacy.embedding, want.data[0].embedding, atol=1e-6)
    assert client.show("emb").capabilities == ["embedding"]
    assert "completion" in client.show("gen").capabilities


def test_each_model_answers_its_own_task_only(server):
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert "/v1/embeddings" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="gen", input="hi")
    assert "task" in e.value.message
    r = httpx.post(server.api + "/rerank", json={"model": "emb", "query": "q", "documents": ["d"]},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and "rerank" in r.json()["error"]["message"]
    r = httpx.post(server.api + "/rerank", json={"model": "rr-two-token-yes", "query": "q",
                                                 "documents": ["d"]}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and "'yes' as 2 tokens" in r.json()["error"]["message"], r.text
    out = client.chat.completions.create(model="gen", max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert out.usage.completion_tokens > 0


def test_metrics_count_inputs_by_kind(server):
    before = httpx.get(server.base_url + "/metrics", timeout=60).text
    sdk(server).embeddings.create(model="emb-mean", input=["a", "b", "c"])
    after = httpx.get(server.base_url + "/metrics", timeout=60).text

    def inputs(text: str) -> float:
        line = [x for x in text.splitlines()
                if x.startswith('specgate_embedding_inputs_total{kind="embed",model="emb-mean"}')]  # fmt: skip
        return float(line[0].split()[-1]) if line else 0.0

    assert inputs(after) - inputs(before) == 3
    assert 'specgate_requests_total{method="embed",model="emb-mean",status="ok"}' in after
