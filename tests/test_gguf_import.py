"""GGUF files imported for the MLX engines (engines/checkpoints/gguf_import/):
each quantized type's mapping onto MLX's affine quantization against gguf's
own dequantization, a tiny Llama round trip through llama.cpp's Q/K
permutation, and the real SmolLM2 GGUF served by mlx_plain / mlx_ngram."""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from pydantic import ValidationError

from specgate.engines.checkpoints.gguf_import import GGUFImportError, import_gguf, importable
from specgate.engines.checkpoints.gguf_import.archs import ARCHS
from specgate.engines.checkpoints.gguf_import.quants import Quantized, pack, to_mlx
from specgate.gateway.config import ModelConfig
from tests.conftest import start_gateway, stop_gateway

# -- the quantized types ---------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_packing_is_mlx_own(bits):
    w = mx.random.normal((3, 64), key=mx.random.key(bits))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    q = mx.round((w - mx.repeat(biases, 32, axis=1)) / mx.repeat(scales, 32, axis=1))
    q = np.clip(np.array(q), 0, 2**bits - 1).astype(np.uint8)
    assert np.array_equal(pack(q, bits), np.array(packed))


def _blocks(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of a type gguf cannot quantize to: random bytes, with
    its float16 multipliers set to small finite values."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    f16 = (rng.random((b.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # its d is the block's last two bytes
        b[:, -2:] = f16[:, :2]
    else:  # d, dmin first
        b[:, :4] = f16
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K])
def test_exact_types_dequantize_as_gguf_does(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    if qtype in (T.Q4_K, T.Q5_K):
        data = _blocks(qtype, rows, cols, rng)
    else:
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    want = dequantize(data, qtype)
    got = to_mlx(data, qtype, rows, cols)
    assert isinstance(got, Quantized)

    def deq(dtype):
        return np.array(mx.dequantize(mx.array(got.weight), mx.array(got.scales).astype(dtype),
                                      mx.array(got.biases).astype(dtype), group_size=got.group_size,
                                      bits=got.bits).astype(mx.float32))  # fmt: skip

    # The integers and the multipliers are gguf's: in float32 only the order
    # of d*q + m's rounding may differ.
    np.testing.assert_allclose(deq(mx.float32), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # As stored (float16 scales for the legacy types), MLX computes s*q + b in
    # float16: two roundings of terms up to the group's largest.
    stored = deq(mx.array(got.scales).dtype)
    group_max = np.repeat(np.abs(want).reshape(rows, -1, 32).max(-1), 32, axis=1)
    assert np.all(np.abs(stored - want) <= 2**-9 * group_max)


def test_types_without_mlx_layout_are_dequantized_to_float16():
    data = _blocks(T.Q6_K, 4, 512, np.random.default_rng(6))
    got = to_mlx(data, T.Q6_K, 4, 512)
    assert isinstance(got, np.ndarray) and got.dtype == np.float16
    np.testing.assert_array_equal(got, dequantize(data, T.Q6_K).astype(np.float16))


# -- tiny models through llama.cpp's layout ---------------------------------------------

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=258,
            max_position_embeddings=512, rope_theta=10000.0)  # fmt: skip
# mlx-lm's own arguments for each family where they go beyond TINY (Gemma-3:
# llama.cpp scales attention by 1/sqrt(head_dim), as query_pre_attn_scalar
# = head_dim does; with 2 layers both are local ones, the window longer than
# the prompt; mlx-lm's needs a whole pattern of layers).
EXTRA = {"gemma3": dict(query_pre_attn_scalar=16, sliding_window=64, sliding_window_pattern=6,
                        rope_local_base_freq=10000.0, num_hidden_layers=6)}  # fmt: skip


def _args(arch: str) -> dict:
    return {**TINY, **EXTRA.get(arch, {})}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's Q/K (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes: a byte-level vocabulary."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b if b in keep else next(extra)) for b in range(256)]


def _gguf_name(arch: str, name: str) -> str:
    """The GGUF name of an mlx-lm parameter (the import's mapping, inverted)."""
    module, kind = name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if module in top:
        return f"{top[module]}.{kind}"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{ {h: g for g, h in ARCHS[arch].block_tensors.items()}[rest]}.{kind}"


# Llama-3.1's published RoPE scaling, which llama.cpp keeps as rope_freqs.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


def _rope_freqs(scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, as written there."""
    import math

    base, dim = TINY["rope_theta"], TINY["head_dim"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _mlx_lm_model(arch: str, tied: bool, rope_scaling: dict | None = None):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{ARCHS[arch].model_type}")
    return module.Model(module.ModelArgs.from_dict(dict(  # (from_dict: the keys it takes)
        model_type=ARCHS[arch].model_type, tie_word_embeddings=tied, rope_scaling=rope_scaling,
        **_args(arch))))


def _tiny_gguf(out: Path, arch: str, tied: bool, rope_scaling: dict | None = None) -> dict[str, np.ndarray]:
    """A random tiny model of `arch` written as llama.cpp's converter would
    (Llama's Q/K rows permuted, Gemma's norms as 1 + w; Q8_0 embeddings, the
    exact legacy types in the blocks, F32 vectors); returns its weights as
    the GGUF holds them, dequantized and as mlx-lm names and orders them:
    what the imported model must compute with."""
    from mlx.utils import tree_flatten

    model = _mlx_lm_model(arch, tied, rope_scaling)
    params = dict(tree_flatten(model.parameters()))
    if tied:
        params.pop("lm_head.weight", None)  # (Gemma-3's model always makes one)
    w = GGUFWriter(str(out), arch)
    w.add_block_count(_args(arch)["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_key_length(TINY["head_dim"])
    w.add_value_length(TINY["head_dim"])
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_rope_dimension_count(TINY["head_dim"])
    if arch == "gemma3":
        w.add_sliding_window(EXTRA["gemma3"]["sliding_window"])
    if rope_scaling:
        w.add_tensor("rope_freqs.weight", _rope_freqs(rope_scaling))
    tokens = [*_byte_tokens(), "hi", "<|end|>"]  # bytes, one merge, an end of text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3])
    w.add_token_merges(["h i"])
    w.add_eos_token_id(257)
    kinds = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
    held = {}
    for n, (name, value) in enumerate(sorted(params.items())):
        value = np.array(value.astype(mx.float32))
        if value.ndim == 1:
            value = value + np.random.default_rng(n).standard_normal(value.shape).astype(np.float32) * 0.1
        gguf_name = _gguf_name(arch, name)
        stem = gguf_name.split(".")[-2]
        if value.ndim == 1:
            stored = value + 1 if arch == "gemma3" and stem.endswith("norm") else value
            w.add_tensor(gguf_name, stored)
            held[name] = value
            continue
        stored = value
        if arch == "llama" and stem in ("attn_q", "attn_k"):
            stored = _permute(value, TINY["num_attention_heads" if stem == "attn_q" else "num_key_value_heads"])
        qtype = T.Q8_0 if stem == "token_embd" else kinds[n % len(kinds)]
        w.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
        # Blocks run along rows, so permuting rows commutes with quantizing them.
        held[name] = dequantize(quantize(value, qtype), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.mark.parametrize(("arch", "tied", "rope_scaling"), [
    ("llama", True, None), ("llama", False, LLAMA3), ("qwen2", True, None), ("qwen3", False, None),
    ("gemma3", True, None)])  # fmt: skip
def test_tiny_model_logits_survive_the_round_trip(tmp_path, arch, tied, rope_scaling):
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model

    held = _tiny_gguf(tmp_path / "tiny.gguf", arch, tied, rope_scaling)
    reference = _mlx_lm_model(arch, tied, rope_scaling)
    reference.load_weights(list(reference.sanitize({k: mx.array(v) for k, v in held.items()}).items()))
    imported, config = load_model(import_gguf(tmp_path / "tiny.gguf", home=tmp_path / "home"))
    assert config["model_type"] == ARCHS[arch].model_type
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert config["rope_scaling"] == rope_scaling
    # Past 2048 positions Llama-3's scaling changes the slow frequencies.
    tokens = mx.array([[1, 50, 7, 200, 33, 91, 4, 18] * (300 if rope_scaling else 1)])
    want = np.array(reference(tokens))
    assert np.abs(want).max() > 0.1
    # As stored: the legacy types' float16 scales round s*q + b in float16,
    # as any MLX model quantized with float16 scales does.
    np.testing.assert_allclose(np.array(imported(tokens)), want, atol=2e-2 * np.abs(want).max())
    # With the same scales in float32 the weights are the file's exactly.
    imported.update(tree_map_with_path(
        lambda k, v: v.astype(mx.float32) if k.endswith(("scales", "biases")) else v,
        imported.parameters()))  # fmt: skip
    np.testing.assert_allclose(np.array(imported(tokens)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_one_import_at_a_time_and_a_failed_one_leaves_nothing(tmp_path):
    import threading

    _tiny_gguf(tmp_path / "tiny.gguf", "llama", True)
    home = tmp_path / "home"

    def fail(done, total, name):
        raise KeyboardInterrupt  # a crash mid-import

    with pytest.raises(KeyboardInterrupt):
        import_gguf(tmp_path / "tiny.gguf", home=home, progress=fail)
    assert [p.name for p in (home / "imports").iterdir() if not p.name.endswith(".lock")] == ["index.json"]
    calls, results = [], []

    def run():
        results.append(import_gguf(tmp_path / "tiny.gguf", home=home,
                                   progress=lambda d, n, name: calls.append(name)))  # fmt: skip

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The second waited for the first's lock, then found its import done.
    assert results[0] == results[1] and len(calls) == len(set(calls))


def test_permuted_rows_are_permuted_back():
    from specgate.engines.checkpoints.gguf_import import _unpermute

    w = np.arange(4 * 2 * 8 * 3).reshape(4 * 2 * 8, 3)
    assert np.array_equal(_unpermute(_permute(w, 4), 4), w)
    assert not np.array_equal(_permute(w, 4), w)


# -- what cannot be imported, and config -------------------------------------------------


def _gguf_of(path: Path, arch: str, **tensors) -> Path:
    w = GGUFWriter(str(path), arch)
    w.add_token_list(_byte_tokens())
    w.add_tokenizer_model("gpt2")
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_architecture_is_named_with_those_supported(tmp_path):
    path = _gguf_of(tmp_path / "m.gguf", "mamba", **{"token_embd.weight": np.zeros((4, 32), np.float32)})
    why = importable(path, home=tmp_path)
    assert "'mamba'" in why and "gemma3, llama, qwen2, qwen3" in why and "llamacpp" in why
    with pytest.raises(GGUFImportError, match="'mamba'"):
        import_gguf(path, home=tmp_path)
    assert not any((tmp_path / "imports").glob("*/config.json"))  # nothing that looks done
    with pytest.raises(ValidationError, match="mlx_plain cannot serve .*'mamba'"):
        ModelConfig(id="m", path=str(path), engines=["mlx_plain"])


def test_config_takes_mlx_engines_for_an_importable_gguf(smollm2_gguf):
    mc = ModelConfig(id="s", path=str(smollm2_gguf), engines=["mlx_plain", "mlx_ngram"])
    assert mc.format.in_process and mc.imports_gguf
    assert ModelConfig(id="s", path=str(smollm2_gguf)).engines == ["llamacpp"]  # the default stays
    with pytest.raises(ValidationError, match="llama.cpp's .*or MLX ones .*not both"):
        ModelConfig(id="s", path=str(smollm2_gguf), engines=["mlx_plain", "llamacpp_ngram"])
    with pytest.raises(ValidationError, match="mlx_mtp drafts with the checkpoint's MTP head"):
        ModelConfig(id="s", path=str(smollm2_gguf), engines=["mlx_mtp"])
    with pytest.raises(ValidationError, match="serve the demo as builtin:demo"):
        ModelConfig(id="s", path="builtin:demo-gguf", engines=["mlx_plain"])


# -- the real model ---------------------------------------------------------------------


def test_real_gguf_imports_once(smollm2_gguf, tmp_path):
    home = tmp_path / "home"
    seen = []
    t0 = time.perf_counter()
    first = import_gguf(smollm2_gguf, home=home, progress=lambda d, n, name: seen.append((d, n)))
    t1 = time.perf_counter()
    assert seen[-1][0] == seen[-1][1] and len(seen) == 272  # one call per tensor
    written = {p: p.stat().st_mtime_ns for p in first.iterdir()}
    again = import_gguf(smollm2_gguf, home=home)
    t2 = time.perf_counter()
    assert again == first and {p: p.stat().st_mtime_ns for p in again.iterdir()} == written
    assert importable(smollm2_gguf, home=home) is None
    # mlx-lm stops where llama.cpp does: on <|endoftext|> (0) and <|im_end|> (2),
    # not only the file's eos_token_id (2).
    assert json.loads((first / "config.json").read_text())["eos_token_id"] == [0, 2]
    print(f"import {t1 - t0:.2f} s, cached {(t2 - t1) * 1000:.1f} ms")
    # Under its content's sha256; the index spares a second start the hashing.
    assert len(first.name) == 64 and (home / "imports" / "index.json").exists()
    assert not list((home / "imports").glob(".*.tmp-*"))


@pytest.fixture(scope="module")
def smol_gw(smollm2_gguf, tmp_path_factory):
    smol = {"path": str(smollm2_gguf), "engines": ["mlx_plain", "mlx_ngram"], "max_context": 1024}
    g = start_gateway({"models": [{"id": "smol", **smol}, {"id": "smol-dense", "dequantize": True, **smol}]},
                      tmp_path_factory.mktemp("gw-gguf-import"), timeout=300)  # fmt: skip
    yield g
    stop_gateway(g)


def _ids(client, prompt: str, method: str, n: int, model: str = "smol") -> list[int]:
    r = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers={"X-Specgate-Method": method})  # fmt: skip
    assert r.headers["x-specgate-plan"].startswith(f"method={method};")
    return r.parse().choices[0].token_ids


def test_served_imported_gguf_answers_as_mlx_lm_does(smol_gw, smollm2_gguf):
    import mlx_lm

    client = openai.OpenAI(base_url=smol_gw.api, api_key="none", max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)  # fmt: skip
    assert "Paris" in chat.choices[0].message.content
    assert f"importing {smollm2_gguf.name} for MLX: 100%" in smol_gw.log()
    # mlx-lm's own greedy generation on the imported directory, the gateway's import.
    imported = next(Path(smol_gw.log_path.parent, "home", "imports").glob("[0-9a-f]*"))
    model, tokenizer = mlx_lm.load(str(imported))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=12) == chat.choices[0].message.content
    # mlx_ngram drafts from the context; greedy, it writes what mlx_plain does.
    copy = "alpha beta gamma delta alpha beta gamma delta alpha beta"
    assert _ids(client, copy, "ngram", 12) == _ids(client, copy, "none", 12)


def test_dequantized_load_is_dense_and_drafting_stays_exact(smol_gw):
    """`dequantize: true` (MLX's CPU backend verifies dense weights cheaper):
    the model's quantized layers load as bfloat16 ones (computed in float32
    where OpenBLAS runs them: engines/precision.py), and n-gram drafting on
    them still writes what plain decoding does."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from specgate.engines.loading import load_mlx_model

    imported = next(Path(smol_gw.log_path.parent, "home", "imports").glob("[0-9a-f]*"))
    stored, dense = load_mlx_model(str(imported)), load_mlx_model(str(imported), dequantize=True)
    assert dense is not stored and dense.prefix_cache is not stored.prefix_cache
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in stored.model.named_modules())
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in dense.model.named_modules())  # fmt: skip
    want = mx.float32 if dense.upcast else mx.bfloat16
    assert {v.dtype for _, v in tree_flatten(dense.model.parameters())} == {want}
    client = openai.OpenAI(base_url=smol_gw.api, api_key="none", max_retries=0, timeout=300)
    copy = "alpha beta gamma delta alpha beta gamma delta alpha beta"
    plain = _ids(client, copy, "none", 12, model="smol-dense")
    assert _ids(client, copy, "ngram", 12, model="smol-dense") == plain


def test_dequantize_is_for_mlx_engines(smollm2_gguf):
    from specgate.engines import precision
    from specgate.gateway.serving.footprint import estimate

    stored = ModelConfig(id="s", path=str(smollm2_gguf), engines=["mlx_plain"], max_context=1024)
    dense = ModelConfig(id="s", path=str(smollm2_gguf), engines=["mlx_plain"], max_context=1024,
                        dequantize=True)  # fmt: skip
    # The memory budget counts what the dense load holds: 2 bytes a parameter,
    # 4 where it computes in float32 (a CPU with OpenBLAS: engines/precision.py).
    per_param = 4 if precision.upcast_applies(1, quantized=False) else 2
    assert estimate(stored).weights < 100 << 20
    assert 125 * per_param << 20 < estimate(dense).weights < 133 * per_param << 20
    with pytest.raises(ValidationError, match="dequantize: for MLX engines; llamacpp run llama.cpp"):
        ModelConfig(id="s", path=str(smollm2_gguf), engines=["llamacpp"], dequantize=True)
