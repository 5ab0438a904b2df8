"""GGUF export of a Qwen3.5 hybrid with its MTP head (specgate/engines/checkpoints/gguf_export.py).

The expectations are llama.cpp's (src/models/qwen35.cpp load_arch_tensors and
conversion/qwen.py), written out here independently of the exporter's tables:
tensor names, ggml shapes (ne order), the +1 on zero-centred norms,
ssm_a = -exp(A_log), and the grouped -> tiled V-head order of the GDN.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specgate.builders.gguf_export import export_gguf
from specgate.builders.tiny import build_qwen35_hybrid

T = "model.language_model."


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return build_qwen35_hybrid(tmp_path_factory.mktemp("gguf") / "hf", seed=0)


@pytest.fixture(scope="module")
def cfg(hf) -> dict:
    return json.loads((hf / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def st(hf) -> dict[str, np.ndarray]:
    return load_file(hf / "model.safetensors")


@pytest.fixture(scope="module")
def gguf_path(hf, tmp_path_factory) -> Path:
    return export_gguf(hf, tmp_path_factory.mktemp("out") / "tiny.gguf")


@pytest.fixture(scope="module")
def exported(gguf_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(gguf_path)


def field(r: gguf.GGUFReader, key: str):
    f = r.get_field(key)
    return None if f is None else f.contents()


def tensors(r: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in r.tensors}


def value(r: gguf.GGUFReader, name: str) -> np.ndarray:
    return np.asarray(tensors(r)[name].data, dtype=np.float32)


def expected_shapes(c: dict, *, mtp: bool) -> dict[str, tuple[int, ...]]:
    """name -> ggml ne, from llama.cpp's qwen35 loader."""
    h, ff, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    dk, nk, nv = c["linear_key_head_dim"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim, value_dim = dk * nk, dk * nv
    conv_dim = 2 * key_dim + value_dim
    shapes = {"token_embd.weight": (h, v), "output_norm.weight": (h,), "output.weight": (h, v)}

    def common(i: int) -> None:
        shapes[f"blk.{i}.attn_norm.weight"] = (h,)
        shapes[f"blk.{i}.post_attention_norm.weight"] = (h,)
        shapes[f"blk.{i}.ffn_gate.weight"] = (h, ff)
        shapes[f"blk.{i}.ffn_up.weight"] = (h, ff)
        shapes[f"blk.{i}.ffn_down.weight"] = (ff, h)

    def attention(i: int) -> None:
        shapes[f"blk.{i}.attn_q.weight"] = (h, hd * nh * 2)  # query + gate
        shapes[f"blk.{i}.attn_k.weight"] = (h, hd * nkv)
        shapes[f"blk.{i}.attn_v.weight"] = (h, hd * nkv)
        shapes[f"blk.{i}.attn_output.weight"] = (hd * nh, h)
        shapes[f"blk.{i}.attn_q_norm.weight"] = (hd,)
        shapes[f"blk.{i}.attn_k_norm.weight"] = (hd,)

    for i, kind in enumerate(c["layer_types"]):
        common(i)
        if kind == "full_attention":
            attention(i)
            continue
        shapes[f"blk.{i}.attn_qkv.weight"] = (h, conv_dim)
        shapes[f"blk.{i}.attn_gate.weight"] = (h, value_dim)
        shapes[f"blk.{i}.ssm_conv1d.weight"] = (c["linear_conv_kernel_dim"], conv_dim)
        shapes[f"blk.{i}.ssm_dt.bias"] = (nv,)
        shapes[f"blk.{i}.ssm_a"] = (nv,)
        shapes[f"blk.{i}.ssm_beta.weight"] = (h, nv)
        shapes[f"blk.{i}.ssm_alpha.weight"] = (h, nv)
        shapes[f"blk.{i}.ssm_norm.weight"] = (dk,)
        shapes[f"blk.{i}.ssm_out.weight"] = (value_dim, h)
    if mtp:
        n = c["num_hidden_layers"]
        common(n)
        attention(n)
        shapes[f"blk.{n}.nextn.eh_proj.weight"] = (2 * h, h)
        shapes[f"blk.{n}.nextn.enorm.weight"] = (h,)
        shapes[f"blk.{n}.nextn.hnorm.weight"] = (h,)
        shapes[f"blk.{n}.nextn.shared_head_norm.weight"] = (h,)
    return shapes


def hf_head(p: int, c: dict) -> int:
    """The HF value head stored at llama.cpp position p (tiled order).

    llama.cpp repeats the key heads tiled, so position p reads key head
    p % n_k; HF's value head j reads key head j // (n_v / n_k). The head at
    p must be the HF head with the same key head: (p % n_k) * r + p // n_k.
    """
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    r = nv // nk
    return (p % nk) * r + p // nk


def test_architecture_and_block_count(exported, cfg):
    assert field(exported, "general.architecture") == "qwen35"
    assert field(exported, "qwen35.block_count") == cfg["num_hidden_layers"] + 1
    assert field(exported, "qwen35.nextn_predict_layers") == 1


def test_hparams_llama_cpp_requires(exported, cfg):
    a = "qwen35."
    assert field(exported, a + "embedding_length") == cfg["hidden_size"]
    assert field(exported, a + "feed_forward_length") == cfg["intermediate_size"]
    assert field(exported, a + "context_length") == cfg["max_position_embeddings"]
    assert field(exported, a + "attention.head_count") == cfg["num_attention_heads"]
    assert field(exported, a + "attention.head_count_kv") == cfg["num_key_value_heads"]
    assert field(exported, a + "attention.key_length") == cfg["head_dim"]
    assert field(exported, a + "attention.value_length") == cfg["head_dim"]
    assert field(exported, a + "attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert field(exported, a + "rope.freq_base") == pytest.approx(1e7)
    assert field(exported, a + "rope.dimension_count") == int(cfg["head_dim"] * 0.25)
    sections = cfg["rope_parameters"]["mrope_section"]
    assert field(exported, a + "rope.dimension_sections") == [*sections, 0]
    assert field(exported, a + "ssm.conv_kernel") == cfg["linear_conv_kernel_dim"]
    assert field(exported, a + "ssm.state_size") == cfg["linear_key_head_dim"]
    assert field(exported, a + "ssm.group_count") == cfg["linear_num_key_heads"]
    assert field(exported, a + "ssm.time_step_rank") == cfg["linear_num_value_heads"]
    inner = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
    assert field(exported, a + "ssm.inner_size") == inner
    assert field(exported, a + "full_attention_interval") == cfg["full_attention_interval"]
    assert field(exported, "general.file_type") == gguf.LlamaFileType.ALL_F32


def test_every_tensor_present_with_llama_cpp_shape(exported, cfg):
    got = {name: tuple(int(n) for n in t.shape) for name, t in tensors(exported).items()}
    assert got == expected_shapes(cfg, mtp=True)
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in exported.tensors)


def test_plain_tensors_round_trip(exported, st, cfg):
    n = cfg["num_hidden_layers"]
    np.testing.assert_array_equal(
        value(exported, "token_embd.weight"), st[T + "embed_tokens.weight"]
    )
    np.testing.assert_array_equal(value(exported, "output.weight"), st["lm_head.weight"])
    full = cfg["layer_types"].index("full_attention")
    for gguf_name, hf_name in [
        (f"blk.{full}.attn_q.weight", f"{T}layers.{full}.self_attn.q_proj.weight"),
        (f"blk.{full}.attn_output.weight", f"{T}layers.{full}.self_attn.o_proj.weight"),
        ("blk.0.ffn_down.weight", f"{T}layers.0.mlp.down_proj.weight"),
        (f"blk.{n}.attn_q.weight", "mtp.layers.0.self_attn.q_proj.weight"),
        (f"blk.{n}.ffn_up.weight", "mtp.layers.0.mlp.up_proj.weight"),
        # [embedding | hidden] input order is the same in HF and llama.cpp.
        (f"blk.{n}.nextn.eh_proj.weight", "mtp.fc.weight"),
    ]:
        np.testing.assert_array_equal(value(exported, gguf_name), st[hf_name], err_msg=gguf_name)


def test_zero_centred_norms_carry_plus_one(exported, st, cfg):
    n = cfg["num_hidden_layers"]
    full = cfg["layer_types"].index("full_attention")
    for gguf_name, hf_name in [
        ("output_norm.weight", T + "norm.weight"),
        ("blk.0.attn_norm.weight", f"{T}layers.0.input_layernorm.weight"),
        ("blk.0.post_attention_norm.weight", f"{T}layers.0.post_attention_layernorm.weight"),
        (f"blk.{full}.attn_q_norm.weight", f"{T}layers.{full}.self_attn.q_norm.weight"),
        (f"blk.{full}.attn_k_norm.weight", f"{T}layers.{full}.self_attn.k_norm.weight"),
        (f"blk.{n}.attn_norm.weight", "mtp.layers.0.input_layernorm.weight"),
        (f"blk.{n}.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
        (f"blk.{n}.nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
        (f"blk.{n}.nextn.shared_head_norm.weight", "mtp.norm.weight"),
    ]:
        np.testing.assert_allclose(value(exported, gguf_name), 1.0 + st[hf_name], err_msg=gguf_name)
    # The GDN gated norm stores its scale directly: no shift.
    np.testing.assert_array_equal(
        value(exported, "blk.0.ssm_norm.weight"), st[f"{T}layers.0.linear_attn.norm.weight"]
    )


def test_gdn_tensors_transformed_and_tiled(exported, st, cfg):
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk = cfg["linear_key_head_dim"]
    assert nk != nv, "the tiny model must exercise the V-head reorder"
    heads = [hf_head(p, cfg) for p in range(nv)]
    assert heads != list(range(nv))
    qk = 2 * nk * dk
    for i, kind in enumerate(cfg["layer_types"]):
        if kind != "linear_attention":
            continue
        p = f"{T}layers.{i}.linear_attn."
        # Per-head vectors: value at position q is HF head hf_head(q).
        np.testing.assert_allclose(
            value(exported, f"blk.{i}.ssm_a"), -np.exp(st[p + "A_log"][heads])
        )
        np.testing.assert_array_equal(
            value(exported, f"blk.{i}.ssm_dt.bias"), st[p + "dt_bias"][heads]
        )
        for gguf_name, hf_name in [("ssm_alpha", "in_proj_a"), ("ssm_beta", "in_proj_b")]:
            np.testing.assert_array_equal(
                value(exported, f"blk.{i}.{gguf_name}.weight"), st[p + hf_name + ".weight"][heads]
            )

        def rows(w: np.ndarray) -> np.ndarray:  # V rows, head by head, tiled
            return np.concatenate([w[h * dk : (h + 1) * dk] for h in heads])

        qkv = st[p + "in_proj_qkv.weight"]
        got = value(exported, f"blk.{i}.attn_qkv.weight")
        np.testing.assert_array_equal(got[:qk], qkv[:qk])  # q and k untouched
        np.testing.assert_array_equal(got[qk:], rows(qkv[qk:]))
        np.testing.assert_array_equal(
            value(exported, f"blk.{i}.attn_gate.weight"), rows(st[p + "in_proj_z.weight"])
        )
        conv = st[p + "conv1d.weight"][:, 0, :]  # HF [channels, 1, kernel]
        got = value(exported, f"blk.{i}.ssm_conv1d.weight")
        np.testing.assert_array_equal(got[:qk], conv[:qk])
        np.testing.assert_array_equal(got[qk:], rows(conv[qk:]))
        out = st[p + "out_proj.weight"]
        np.testing.assert_array_equal(value(exported, f"blk.{i}.ssm_out.weight"), rows(out.T).T)


def test_tokenizer_metadata(exported, hf, cfg):
    tok = json.loads((hf / "tokenizer.json").read_text())
    tcfg = json.loads((hf / "tokenizer_config.json").read_text())
    assert field(exported, "tokenizer.ggml.model") == "gpt2"
    # Our tokenizer's split regex is Qwen3.5's, which llama.cpp calls "qwen35".
    assert field(exported, "tokenizer.ggml.pre") == "qwen35"
    tokens = field(exported, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"]
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert all(tokens[i] == t for t, i in vocab.items())
    types = field(exported, "tokenizer.ggml.token_type")
    for t in tok["added_tokens"]:
        assert types[t["id"]] == gguf.TokenType.CONTROL
    assert all(types[i] == gguf.TokenType.NORMAL for i in tok["model"]["vocab"].values())
    merges = field(exported, "tokenizer.ggml.merges")
    assert len(merges) == len(tok["model"]["merges"]) and all(" " in m for m in merges)
    assert field(exported, "tokenizer.ggml.eos_token_id") == vocab["<|im_end|>"]
    assert field(exported, "tokenizer.ggml.bos_token_id") == vocab["<|endoftext|>"]
    assert field(exported, "tokenizer.ggml.padding_token_id") == vocab["<|endoftext|>"]
    assert field(exported, "tokenizer.ggml.add_bos_token") is False
    assert field(exported, "tokenizer.chat_template") == tcfg["chat_template"]


def test_without_mtp(hf, cfg, tmp_path):
    r = gguf.GGUFReader(export_gguf(hf, tmp_path / "trunk.gguf", include_mtp=False))
    assert field(r, "qwen35.block_count") == cfg["num_hidden_layers"]
    assert field(r, "qwen35.nextn_predict_layers") in (None, 0)
    names = set(tensors(r))
    assert not any("nextn" in n for n in names)
    assert names == set(expected_shapes(cfg, mtp=False))


def test_f16_keeps_norms_conv_and_vectors_f32(hf, st, tmp_path):
    r = gguf.GGUFReader(export_gguf(hf, tmp_path / "f16.gguf", outtype="f16"))
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    f32 = gguf.GGMLQuantizationType.F32
    for name, t in tensors(r).items():
        vector = len(t.shape) == 1 or "norm" in name or "ssm_conv1d" in name
        assert (t.tensor_type == f32) == vector, name
    np.testing.assert_allclose(
        value(r, "token_embd.weight"), st[T + "embed_tokens.weight"], rtol=1e-3, atol=1e-3
    )


def test_checkpoint_without_mtp_tensors(tmp_path):
    hf = build_qwen35_hybrid(tmp_path / "nomtp", seed=1, with_mtp=False)
    with pytest.raises(ValueError, match="MTP"):
        export_gguf(hf, tmp_path / "x.gguf")
    r = gguf.GGUFReader(export_gguf(hf, tmp_path / "y.gguf", include_mtp=False))
    assert field(r, "qwen35.block_count") == 4


def test_rejects_unknown_outtype(hf, tmp_path):
    with pytest.raises(ValueError, match="outtype"):
        export_gguf(hf, tmp_path / "q.gguf", outtype="q8_0")


# The file in a real llama-server with draft-mtp (the project's own build,
# see the llama_server_binary fixture).


LISTENING = re.compile(r"listening on http://127\.0\.0\.1:\d+")


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, log: Path, *extra: str):
    # Port 0: it binds one of its own, and logs which once its model is loaded.
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "0",
             "-c", "512", "-np", "1", "-t", "1", *extra],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            if url is None and (m := LISTENING.search(log.read_text(errors="replace"))):
                url = m.group(0).removeprefix("listening on ")
            try:
                if url and httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def complete(url: str, prompt: list[int] | str, n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False}  # fmt: skip
    resp = httpx.post(url + "/completion", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.timeout(1800)  # the first use on a machine builds llama-server
def test_llama_server_greedy_matches_mlx_reference(hf, gguf_path, tmp_path, llama_server_binary):
    """Trunk numerics: llama.cpp's greedy tokens equal mlx-lm's on the HF checkpoint."""
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(hf))
    prompt = tok.encode("def main():\n    return value + 1")
    ids, ref = list(prompt), []
    for _ in range(16):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        top2 = mx.sort(logits)[-2:]
        if float(top2[1] - top2[0]) < 1e-3:
            break  # a near-tie: f32 rounding may legitimately pick either
        ids.append(int(mx.argmax(logits)))
        ref.append(ids[-1])
    assert len(ref) >= 4
    log = tmp_path / "server.log"
    with llama_server(llama_server_binary, gguf_path, log, "--spec-type", "draft-mtp",
                      "--spec-draft-n-max", "2") as url:
        got = complete(url, prompt, len(ref))["tokens"]
    assert got == ref
    assert "creating MTP draft context" in log.read_text()


@pytest.mark.timeout(1800)  # the first use on a machine builds llama-server
def test_llama_server_accepts_an_aligned_mtp_head(hf, tmp_path, llama_server_binary):
    """MTP wiring: a head built to predict exactly the trunk's next token is always accepted.

    With every residual branch zeroed the trunk is a bigram model
    (lm_head(norm(embed(x)))); with fc = [I | 0] and unit norms the MTP head
    computes the same function of the token it is fed, so every draft must be
    accepted. A missing +1 on a nextn norm, a swapped eh_proj input order or a
    misnamed tensor would all drop the acceptance to ~0.
    """
    aligned = tmp_path / "aligned"
    shutil.copytree(hf, aligned)
    st = load_file(aligned / "model.safetensors")
    for k in st:
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            st[k] = np.zeros_like(st[k])
        elif k.endswith("norm.weight") and "linear_attn" not in k or k.startswith("mtp.pre_fc"):
            st[k] = np.zeros_like(st[k])  # zero-centred: effective scale 1
    h = st["mtp.fc.weight"].shape[0]
    st["mtp.fc.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
    save_file(st, aligned / "model.safetensors", metadata={"format": "pt"})
    out = export_gguf(aligned, tmp_path / "aligned.gguf")
    with llama_server(llama_server_binary, out, tmp_path / "server.log", "--spec-type",
                      "draft-mtp") as url:
        timings = complete(url, "def main():", 32)["timings"]
    assert timings["draft_n"] > 0
    assert timings["draft_n_accepted"] == timings["draft_n"]
