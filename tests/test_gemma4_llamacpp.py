"""A Gemma-4 target and its assistant drafter in a real llama-server (draft-mtp).

The tiny dense Gemma-4 (sliding window 16, sliding and full layers) and a
random assistant built for it are exported to GGUF (specgate/builders/
gguf_gemma4.py): the target as `gemma4`, the assistant as its own
`gemma4-assistant` file, served as

    llama-server -m target.gguf -md assistant.gguf --spec-type draft-mtp

Checked: the files carry llama.cpp's names and shapes; plain greedy over a
40-token prompt (past the window) equals mlx-lm's greedy decoding of the HF
checkpoint; with the assistant drafting, the output is the plain one and the
server reports the drafts; and an assistant built to predict exactly what a
(bigram) target will say has every draft accepted, which a wrong tensor name,
a swapped pre_projection input order or a head not tied to the assistant's
own embedding would break.

Numerics: the servers run with an F32 KV cache and flash attention off (an
F16 cache and the CPU flash-attention kernel each move the logprobs by up to
~4e-2 at 40 tokens, measured). What remains is ggml's CPU GELU, which looks
the result up in an F16 table (GGML_GELU_FP16 in ggml/src/ggml-cpu/vec.h:
fp16(gelu(fp16(x)))): it moves the logprobs by up to ~1.2e-2 from an exact
f32 forward, and by ~2e-3 from one that rounds GELU the same way (an input
near an F16 rounding boundary can still land on the other side). So the
greedy tokens are compared with two mlx references: plain mlx-lm, where a
divergence is allowed only at a top-2 margin below 2.5e-2, and mlx-lm with
ggml's GELU rounding, below 5e-3. The tiny model's margins are mostly
larger, so in practice all 24 tokens agree.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import gguf
import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from greedy import greedy_reference
from mlx_lm.utils import load_model
from safetensors.numpy import load_file, save_file
from test_gguf_export import complete, llama_server

from specgate.builders.drafters import build_gemma4_assistant
from specgate.builders.gemma4 import build_gemma4
from specgate.builders.gguf_gemma4 import export_gemma4_assistant_gguf, export_gemma4_gguf

pytestmark = pytest.mark.timeout(1800)  # the first use on a machine builds llama-server

PROMPT = [(37 * i + 11) % 2000 for i in range(40)]  # 40 ids, past the 16-token window
N = 24
EXACT_F32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")
DRAFT = ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3")
PLAIN_TOL = 2.5e-2  # plain mlx-lm vs ggml's F16-table GELU (see the module docstring)
GGML_TOL = 5e-3  # mlx-lm with ggml's GELU rounding


@pytest.fixture(scope="module")
def binary(llama_server_binary) -> Path:
    # specgate's own build (conftest): on an empty SPECGATE_HOME, as in CI,
    # this is where it gets built; a skip here would hide the whole file.
    return llama_server_binary


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma4_hf")
    target = build_gemma4(root / "target", variant="dense", sliding_window=16)
    assistant = build_gemma4_assistant(root / "assistant", target=target, tokenizer=False)
    return target, assistant


@pytest.fixture(scope="module")
def ggufs(hf, tmp_path_factory) -> tuple[Path, Path]:
    target, assistant = hf
    out = tmp_path_factory.mktemp("gemma4_gguf")
    return (
        export_gemma4_gguf(target, out / "target.gguf"),
        export_gemma4_assistant_gguf(assistant, out / "assistant.gguf", tokenizer_dir=target),
    )


def ggml_gelu(x: mx.array) -> mx.array:
    """ggml's CPU GELU (vec.h, GGML_GELU_FP16): the tanh GELU of the input
    rounded to F16, itself rounded to F16; x itself at >= 10, 0 at <= -10."""
    h = x.astype(mx.float16).astype(mx.float32)
    g = 0.5 * h * (1.0 + mx.tanh(math.sqrt(2 / math.pi) * h * (1.0 + 0.044715 * h * h)))
    g = g.astype(mx.float16).astype(mx.float32)
    return mx.where(x >= 10.0, x, mx.where(x <= -10.0, mx.zeros_like(x), g))


@pytest.fixture(scope="module")
def references(hf) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens and top-2 margins: plain mlx-lm, and with ggml's GELU."""
    model, _ = load_model(hf[0])
    model.set_dtype(mx.float32)
    refs = {"plain": greedy_reference(model, PROMPT, N)}
    gelu = nn.gelu_approx  # mlx-lm's gemma4_text calls nn.gelu_approx at run time
    nn.gelu_approx = ggml_gelu
    try:
        refs["ggml"] = greedy_reference(model, PROMPT, N)
    finally:
        nn.gelu_approx = gelu
    return refs


def assert_greedy_within(got: list[int], want: list[int], margins: list[float], tol: float):
    """Equal, or diverging where the reference's top-2 margin is below tol."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            assert margins[i] < tol, (
                f"diverged at token {i} ({g} != {w}) where the reference's top-2 margin "
                f"is {margins[i]:.3g}, not below {tol}"
            )
            return
    assert len(got) == len(want)


# --------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------


def fields(path: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    return kv, {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}


def test_files_carry_llama_cpp_names_and_shapes(hf, ggufs):
    """Written out from src/models/gemma4*.cpp's loaders, not the exporter's tables."""
    (t_kv, t_shapes), (a_kv, a_shapes) = fields(ggufs[0]), fields(ggufs[1])
    assert t_kv["general.architecture"] == "gemma4"
    assert a_kv["general.architecture"] == "gemma4-assistant"
    h, v, ff, nh, nkv, hd, ghd = 128, 2048, 256, 4, 2, 32, 64
    swa = [True, True, False, True, True, False]
    for key, want in {
        "block_count": 6, "embedding_length": h, "feed_forward_length": ff,
        "attention.head_count": nh, "attention.head_count_kv": nkv,
        "attention.key_length": ghd, "attention.value_length": ghd,
        "attention.key_length_swa": hd, "attention.value_length_swa": hd,
        "attention.sliding_window": 16, "attention.sliding_window_pattern": swa,
        "attention.shared_kv_layers": 0, "embedding_length_per_layer_input": 0,
        "rope.dimension_count": ghd, "rope.dimension_count_swa": hd,
        "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4, "final_logit_softcapping": 30.0,
    }.items():  # fmt: skip
        assert t_kv[f"gemma4.{key}"] == pytest.approx(want), key
    want_t = {"token_embd.weight": (h, v), "output_norm.weight": (h,), "rope_freqs.weight": (ghd // 2,)}
    for i, is_swa in enumerate(swa):
        d = hd if is_swa else ghd
        want_t |= {
            f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (h, nh * d),
            f"blk.{i}.attn_k.weight": (h, nkv * d), f"blk.{i}.attn_v.weight": (h, nkv * d),
            f"blk.{i}.attn_output.weight": (nh * d, h), f"blk.{i}.attn_q_norm.weight": (d,),
            f"blk.{i}.attn_k_norm.weight": (d,), f"blk.{i}.post_attention_norm.weight": (h,),
            f"blk.{i}.ffn_norm.weight": (h,), f"blk.{i}.ffn_gate.weight": (h, ff),
            f"blk.{i}.ffn_up.weight": (h, ff), f"blk.{i}.ffn_down.weight": (ff, h),
            f"blk.{i}.post_ffw_norm.weight": (h,), f"blk.{i}.layer_output_scale.weight": (1,),
        }  # fmt: skip
    assert t_shapes == want_t
    # The assistant: every block an MTP block; the target's width is its output.
    ah, aff, anh = 64, 128, 2
    assert a_kv["gemma4-assistant.block_count"] == 4
    assert a_kv["gemma4-assistant.nextn_predict_layers"] == 4
    assert a_kv["gemma4-assistant.embedding_length"] == ah
    assert a_kv["gemma4-assistant.embedding_length_out"] == h
    assert a_kv["gemma4-assistant.attention.shared_kv_layers"] == 4
    assert a_kv["gemma4-assistant.attention.sliding_window_pattern"] == [True, True, True, False]
    assert "gemma4-assistant.final_logit_softcapping" not in a_kv
    want_a = {
        "token_embd.weight": (ah, v), "output_norm.weight": (ah,), "rope_freqs.weight": (ghd // 2,),
        "nextn.pre_projection.weight": (2 * h, ah), "nextn.post_projection.weight": (ah, h),
    }  # fmt: skip
    for i, is_swa in enumerate([True, True, True, False]):
        d = hd if is_swa else ghd
        want_a |= {
            f"blk.{i}.attn_norm.weight": (ah,), f"blk.{i}.attn_q.weight": (ah, anh * d),
            f"blk.{i}.attn_output.weight": (anh * d, ah), f"blk.{i}.attn_q_norm.weight": (d,),
            f"blk.{i}.post_attention_norm.weight": (ah,), f"blk.{i}.ffn_norm.weight": (ah,),
            f"blk.{i}.ffn_gate.weight": (ah, aff), f"blk.{i}.ffn_up.weight": (ah, aff),
            f"blk.{i}.ffn_down.weight": (aff, ah), f"blk.{i}.post_ffw_norm.weight": (ah,),
            f"blk.{i}.layer_output_scale.weight": (1,),
        }  # fmt: skip
    assert a_shapes == want_a  # no masked_embedding: llama.cpp drafts from the full head
    # Proportional rope on full layers: 25% of the pairs rotate, the rest are inert.
    r = gguf.GGUFReader(ggufs[0])
    rope = next(np.asarray(t.data) for t in r.tensors if t.name == "rope_freqs.weight")
    np.testing.assert_array_equal(rope, np.array([1.0] * 8 + [1e30] * 24, dtype=np.float32))


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_tokens(binary, ggufs, tmp_path_factory) -> list[int]:
    log = tmp_path_factory.mktemp("plain") / "server.log"
    with llama_server(binary, ggufs[0], log, *EXACT_F32) as url:
        return complete(url, PROMPT, N)["tokens"]


def test_plain_greedy_matches_mlx(plain_tokens, references):
    tokens, margins = references["plain"]
    assert len(tokens) == N
    assert_greedy_within(plain_tokens, tokens, margins, PLAIN_TOL)
    tokens, margins = references["ggml"]
    assert_greedy_within(plain_tokens, tokens, margins, GGML_TOL)


def test_draft_mtp_output_is_the_plain_one(binary, ggufs, plain_tokens, references, tmp_path):
    log = tmp_path / "server.log"
    with llama_server(binary, ggufs[0], log, *EXACT_F32, "-md", str(ggufs[1]), *DRAFT) as url:
        out = complete(url, PROMPT, N)
    text = log.read_text()
    assert "loading draft model" in text
    # The assistant's sliding layers read the target's layer n_layer-2 (4),
    # its full layer the target's layer n_layer-1 (5) (src/llama-model.cpp).
    for i in range(3):
        assert f"layer   {i}: sharing with layer 4" in text
    assert "layer   3: sharing with layer 5" in text
    # Verification runs the target on several rows at once, which may round
    # differently: a divergence is allowed only at a near-tie of the reference.
    _, margins = references["ggml"]
    assert_greedy_within(out["tokens"], plain_tokens, margins, GGML_TOL)
    timings = out["timings"]
    assert timings["draft_n"] > 0  # the assistant drafted (a random one: ~none accepted)
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]


def test_moe_target_with_its_assistant(binary, tmp_path):
    """The 26B-A4B shape (experts beside the MLP, keys as values on full
    layers with their own K/V head count): the assistant built for it
    declares the same K/V heads, else llama.cpp's shared-KV view asserts."""
    target = build_gemma4(tmp_path / "moe", variant="moe", sliding_window=16)
    assistant = build_gemma4_assistant(tmp_path / "moe-a", target=target, tokenizer=False)
    t_gguf = export_gemma4_gguf(target, tmp_path / "moe.gguf")
    a_gguf = export_gemma4_assistant_gguf(assistant, tmp_path / "moe-a.gguf", tokenizer_dir=target)
    with llama_server(binary, t_gguf, tmp_path / "plain.log", *EXACT_F32) as url:
        plain = complete(url, PROMPT, N)["tokens"]
    with llama_server(binary, t_gguf, tmp_path / "draft.log", *EXACT_F32, "-md", str(a_gguf),
                      *DRAFT) as url:  # fmt: skip
        out = complete(url, PROMPT, N)
    model, _ = load_model(target)
    model.set_dtype(mx.float32)
    _, margins = greedy_reference(model, PROMPT, N)
    assert_greedy_within(out["tokens"], plain, margins, PLAIN_TOL)
    assert out["timings"]["draft_n"] > 0


def _aligned_pair(hf: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    """A target that is a bigram model and an assistant that computes it.

    Target: attention and MLP outputs zeroed and layer scalars 1, so its
    logits are E . norm(E[x] * sqrt(H)) (softcapped); E's columns past 64
    are zeroed and its final norm's scales are random. Assistant: its layers zeroed alike, pre_projection picking
    the first 64 dims of the target-embedding half of its input, its tied
    embedding E[:, :64] and its final norm sqrt(2) * the target's (an RMS
    over 64 dims, not 128): its logits are the target's next ones, before
    the (monotone) softcap, so every draft is the target's own greedy token.
    """
    target, assistant = root / "target", root / "assistant"
    shutil.copytree(hf[0], target)
    shutil.copytree(hf[1], assistant)
    t = load_file(target / "model.safetensors")
    p = "model.language_model."
    for k in t:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = np.zeros_like(t[k])
        elif k.endswith("layer_scalar"):
            t[k] = np.ones_like(t[k])
    emb = t[p + "embed_tokens.weight"]
    ah = 64
    emb[:, ah:] = 0.0
    # A final norm of random sign: with the stored ~1 scales, E[x] . E[x] would
    # win and the bigram model would repeat its input token forever.
    w = np.random.default_rng(0).standard_normal(emb.shape[1]).astype(np.float32)
    t[p + "norm.weight"] = w
    save_file(t, target / "model.safetensors", metadata={"format": "pt"})
    a = load_file(assistant / "model.safetensors")
    for k in a:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            a[k] = np.zeros_like(a[k])
        elif k.endswith("layer_scalar"):
            a[k] = np.ones_like(a[k])
    pre = np.zeros_like(a["pre_projection.weight"])  # [64, 2 * 128]: [embedding | hidden]
    pre[:, :ah] = np.eye(ah, dtype=np.float32)
    a["pre_projection.weight"] = pre
    a["model.embed_tokens.weight"] = np.ascontiguousarray(emb[:, :ah])
    a["model.norm.weight"] = (np.sqrt(2.0) * t[p + "norm.weight"][:ah]).astype(np.float32)
    save_file(a, assistant / "model.safetensors", metadata={"format": "pt"})
    return target, assistant


def test_aligned_assistant_has_every_draft_accepted(binary, hf, tmp_path):
    target, assistant = _aligned_pair(hf, tmp_path / "hf")
    t_gguf = export_gemma4_gguf(target, tmp_path / "target.gguf")
    a_gguf = export_gemma4_assistant_gguf(assistant, tmp_path / "assistant.gguf", tokenizer_dir=target)
    log = tmp_path / "server.log"
    with llama_server(binary, t_gguf, log, *EXACT_F32) as url:
        plain = complete(url, PROMPT, N)["tokens"]
    with llama_server(binary, t_gguf, log, *EXACT_F32, "-md", str(a_gguf), *DRAFT) as url:
        out = complete(url, PROMPT, N)
    assert out["tokens"] == plain
    timings = out["timings"]
    assert timings["draft_n"] > 0
    assert timings["draft_n_accepted"] == timings["draft_n"]


# The gateway
# --------------------------------------------------------------------------


def test_a_gemma4_gguf_drafts_with_its_assistant_behind_the_gateway(
    llama_server_binary, hf, ggufs, tmp_path
):
    """`drafter:` on a GGUF model is the assistant GGUF llamacpp_mtp runs with
    (-md): the openai SDK gets plain decoding's tokens with either method,
    the server's drafts are counted; without a drafter llamacpp_mtp is refused
    saying what to set, and an assistant for another size fails the model."""
    import openai

    from tests.conftest import start_gateway, stop_gateway

    exact = {"extra_args": list(EXACT_F32), "threads": 1}  # one thread: docs/DESIGN.md, Testing
    g = start_gateway({"llama_server": {"binary": str(llama_server_binary)}, "models": [
        {"id": "g4", "path": str(ggufs[0]), "engines": ["llamacpp", "llamacpp_mtp"],
         "drafter": str(ggufs[1]), "llamacpp": exact, "max_context": 512, "max_concurrent": 1},
        {"id": "g4-alone", "path": str(ggufs[0]), "engines": ["llamacpp", "llamacpp_mtp"],
         "llamacpp": exact, "max_context": 512, "max_concurrent": 1},
    ]}, tmp_path)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=g.api, api_key="none", max_retries=0, timeout=120)
        ids = {}
        for method in ("mtp", "none"):
            raw = client.completions.with_raw_response.create(
                model="g4", prompt=PROMPT, max_tokens=N, temperature=0,
                extra_headers={"X-Specgate-Method": method},
                extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
            assert raw.headers["x-specgate-plan"].startswith(
                "method=llamacpp_mtp;" if method == "mtp" else "method=none;")
            ids[method] = raw.parse().choices[0].token_ids
        tokens, margins = greedy_reference(load_model(hf[0])[0], PROMPT, N)
        assert_greedy_within(ids["mtp"], ids["none"], margins, GGML_TOL)
        metrics = httpx.get(g.base_url + "/metrics").text
        assert 'specgate_spec_decode_num_drafts_total{method="llamacpp_mtp",model="g4"}' in metrics
        with pytest.raises(openai.BadRequestError, match="-assistant GGUF.*`drafter:`"):
            client.completions.create(model="g4-alone", prompt=PROMPT, max_tokens=4,
                                      extra_headers={"X-Specgate-Method": "mtp"})
    finally:
        stop_gateway(g)
    other = build_gemma4(tmp_path / "other", hidden_size=96)
    wrong = export_gemma4_assistant_gguf(
        build_gemma4_assistant(tmp_path / "other-a", target=other, tokenizer=False),
        tmp_path / "other-a.gguf", tokenizer_dir=other)  # fmt: skip
    (tmp_path / "second").mkdir()
    with pytest.raises(RuntimeError, match=r"g4-wrong failed to load: .*hidden size 96 "
                                           r"\(gemma4-assistant.embedding_length_out\)"):
        start_gateway({"llama_server": {"binary": str(llama_server_binary)}, "models": [
            {"id": "g4-wrong", "path": str(ggufs[0]), "engines": ["llamacpp", "llamacpp_mtp"],
             "drafter": str(wrong), "llamacpp": {"threads": 1}}]},
                      (tmp_path / "second").resolve())  # fmt: skip


def test_inspect_names_the_pair(ggufs):
    from specgate.engines.checkpoints.inspect import inspect_checkpoint

    target, assistant = (inspect_checkpoint(str(p)) for p in ggufs)
    assert target.verdict == "ar-only" and not target.problems
    assert {e.engine: e.methods for e in target.engines} == {
        "llamacpp": ["none", "llamacpp_mtp"], "llamacpp_ngram": ["llamacpp_ngram"]}  # any GGUF drafts n-grams
    assert any("-assistant GGUF" in n and "`drafter:`" in n for n in target.notes)
    assert assistant.verdict == "verified" and not assistant.problems
    assert any("`drafter:` of the gemma4 GGUF" in n for n in assistant.notes)
