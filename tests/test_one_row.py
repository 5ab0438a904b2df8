"""A decoder layer's one-row step as compiled halves (engines/forwards/one_row.py):
the tokens equal the stock model's, on tiny qwen3 layers in every dtype a
checkpoint comes in and on a real pretrained llama (SmolLM2); where the
halves would differ from the stock call, the layer keeps the stock call."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3
from mlx_lm.utils import load_model

from specgate.engines.forwards import one_row
from specgate.engines.forwards.one_row import compile_one_row
from specgate.kernels import hook

PROMPT = list(range(5, 60))


def tiny_qwen3(dtype, quantized: bool):
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=3,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, rms_norm_eps=1e-6, vocab_size=1024,
                           max_position_embeddings=4096, rope_theta=1e4,
                           tie_word_embeddings=False)  # fmt: skip
    mx.random.seed(3)
    model = qwen3.Model(args)
    model.set_dtype(dtype)
    if quantized:
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def greedy(model, n: int = 48) -> list[int]:
    return [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("dtype,quantized", [(mx.float32, False), (mx.bfloat16, False),
                                             (mx.float16, False), (mx.bfloat16, True)])  # fmt: skip
def test_compiled_halves_decode_as_the_stock_layers(dtype, quantized):
    stock, compiled = tiny_qwen3(dtype, quantized), tiny_qwen3(dtype, quantized)
    hook.fuse_siblings(compiled)  # as loading.py does, before
    assert compile_one_row(compiled) == 3
    assert all(type(layer).__name__ == "OneRowTransformerBlock" for layer in compiled.model.layers)
    assert greedy(compiled) == greedy(stock)
    assert compile_one_row(compiled) == 3  # a second call changes nothing


def test_halves_that_differ_from_the_stock_call_are_not_kept(monkeypatch):
    model = tiny_qwen3(mx.float32, False)
    real = one_row._halves

    def off_by_a_little(layer):  # failure injection: halves that round differently
        before, after = real(layer)
        return before, mx.compile(lambda x, attended: after(x, attended) * (1 + 1e-6))

    monkeypatch.setattr(one_row, "_halves", off_by_a_little)
    assert compile_one_row(model) == 0
    assert all(type(layer) is qwen3.TransformerBlock for layer in model.model.layers)
    assert all("_specgate_one_row" not in layer.__dict__ for layer in model.model.layers)


def test_other_families_keep_their_stock_layers(tiny_model):
    model, _ = load_model(tiny_model)  # the session's Qwen3.5 hybrid
    classes = [type(layer) for layer in model.layers]
    assert compile_one_row(model) == 0
    assert [type(layer) for layer in model.layers] == classes


def test_a_real_llama_decodes_as_mlx_lm_does(smollm2_gguf, tmp_path):
    from specgate.engines.checkpoints.gguf_import import import_gguf
    from specgate.engines.loading import load_mlx_model

    path = import_gguf(smollm2_gguf, home=tmp_path)
    loaded = load_mlx_model(str(path))  # loading compiles the halves
    stock, _ = load_model(path)
    layers = loaded.model.model.layers
    # Every layer kept its halves: each was bit-equal to its stock call on the real weights.
    assert all(type(layer).__name__.startswith("OneRow") for layer in layers), len(layers)
    prompt = loaded.tokenizer.encode("Write a short poem about the sea and the wind.")
    want = [t for t, _ in generate_step(mx.array(prompt), stock, max_tokens=12)]
    got = [t for t, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=12)]
    assert got == want
