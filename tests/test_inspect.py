"""`specgate inspect`: a verdict for every published format and every trap.

Checkpoints come from the tiny builders (the published layouts, random
weights) and the trap helpers that break them the ways conversions do in
the wild; GGUF files are written here with gguf.GGUFWriter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from specgate.builders.drafters import (
    build_dflash_drafter,
    build_dspark_drafter,
    build_gemma4_assistant,
)
from specgate.builders.tiny import (
    LAYOUT_CONFIRMED,
    apply_double_norm_shift,
    apply_gemma4_norm_shift,
    build_gemma4,
    build_qwen3_dense,
    build_qwen3_next,
    build_qwen35_hybrid,
    build_qwen35_moe,
    strip_mtp,
)
from specgate.engines import registry
from specgate.engines.checkpoints.inspect import UsageError, inspect_checkpoint, render_text

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("inspect")


@pytest.fixture(scope="module")
def hybrid(models) -> Path:
    return build_qwen35_hybrid(models / "hybrid")


@pytest.fixture(scope="module")
def stripped(models) -> Path:
    return strip_mtp(build_qwen35_hybrid(models / "stripped"))


@pytest.fixture(scope="module")
def dense(models) -> Path:
    return build_qwen3_dense(models / "dense")


def codes(report) -> list[str]:
    return [p.code for p in report.problems]


def engines(report) -> dict[str, list[str]]:
    """The engines the report suggests, each one the registry has (the
    wording once named an `mlx_block` that never existed)."""
    found = {e.engine: e.methods for e in report.engines}
    assert set(found) <= set(registry.names()), f"no such engines: {set(found) - set(registry.names())}"
    for name, methods in found.items():
        assert set(methods) <= set(registry.methods()), (name, methods)
    return found


# ---------------------------------------------------------------- targets


def test_qwen35_hybrid_with_mtp_is_verified(hybrid):
    r = inspect_checkpoint(str(hybrid))
    assert r.verdict == "verified" and r.problems == []
    assert r.layout == "hf" and r.layer_types == {"linear_attention": 3, "full_attention": 1}
    assert r.mtp["declared"] == r.mtp["present"] == 1 and r.mtp["prefix"] == "mtp."
    assert engines(r) == {"mlx_plain": ["none"], "mlx_mtp": ["mtp"], "mlx_dflash": ["dflash"],
                          "mlx_dspark": ["dspark"], "mlx_ngram": ["ngram"]}
    # 1 full-attention layer x 2 kv heads x head_dim 32 x (K, V) x float32, per 1024 tokens.
    assert r.memory.kv_cache_bytes_per_1k_tokens == 1 * 2 * 32 * 2 * 4 * 1024
    assert r.memory.mtp_kv_cache_bytes_per_1k_tokens == r.memory.kv_cache_bytes_per_1k_tokens
    # 3 GDN layers: conv window 3 x (2*2*32 + 4*32) float32 + state 4 x 32 x 32 float32.
    assert r.memory.recurrent_state_bytes == 3 * (3 * 256 * 4 + 4 * 32 * 32 * 4)
    assert 0 < r.memory.mtp_head_bytes < r.memory.weights_bytes
    assert r.memory.weights_bytes == sum(r.bytes_by_dtype.values())


@pytest.mark.parametrize("build", [
    pytest.param(lambda d: build_qwen35_moe(d), id="qwen35_moe-fused"),
    pytest.param(lambda d: build_qwen35_moe(d, experts="per_expert"),
                 id="qwen35_moe-per_expert"),
    pytest.param(lambda d: build_qwen3_next(d), id="qwen3_next"),
    pytest.param(lambda d: build_qwen3_next(d, mtp_config_keys=("num_nextn_predict_layers",)), id="qwen3_next-declared"),
])
def test_moe_and_next_with_mtp_are_verified(tmp_path, build):
    r = inspect_checkpoint(str(build(tmp_path / "m")))
    assert r.verdict == "verified", render_text(r)
    assert r.mtp["present"] == 1 and "mlx_mtp" in engines(r)


@pytest.mark.parametrize("build", [build_qwen35_hybrid, build_qwen35_moe])
def test_text_only_save_is_a_plain_target(tmp_path, build):
    """As transformers saves Qwen3_5(Moe)ForCausalLM: flat qwen3_5(_moe)_text, no mtp.*."""
    r = inspect_checkpoint(str(build(tmp_path / "m", text_only=True)))
    assert r.model_type.endswith("_text") and r.family.startswith("Qwen3.5/3.6")
    assert r.verdict == "no-mtp-heads" and codes(r) == ["mtp_stripped"]
    assert "a text-only save drops them" in r.problems[0].message
    assert engines(r)["mlx_plain"] == ["none"] and "mlx_mtp" not in engines(r)


def test_mtp_declared_but_stripped_is_no_mtp_heads(stripped):
    r = inspect_checkpoint(str(stripped))
    assert r.verdict == "no-mtp-heads" and r.exit_code == 1
    assert codes(r) == ["mtp_stripped"]
    p = r.problems[0]
    assert "config declares 1 MTP layer" in p.message and "no mtp.* tensors" in p.message
    assert "re-convert" in p.action and "plain decoding" in p.action
    # Plain decoding (and drafters) still serve it; the MTP engine does not.
    assert "mlx_mtp" not in engines(r) and engines(r)["mlx_plain"] == ["none"]


def test_builder_without_mtp_is_the_same_trap(tmp_path):
    r = inspect_checkpoint(str(build_qwen35_hybrid(tmp_path / "m", with_mtp=False)))
    assert r.verdict == "no-mtp-heads" and codes(r) == ["mtp_stripped"]


def test_qwen3_next_stripped(tmp_path):
    # Qwen3-Next releases declare nothing, so a stripped copy cannot be told
    # from a model without a head: plain decoding, with the suspicion named.
    r = inspect_checkpoint(str(strip_mtp(build_qwen3_next(tmp_path / "a"))))
    assert r.verdict == "ar-only" and codes(r) == ["mtp_maybe_stripped"]
    declared = build_qwen3_next(tmp_path / "b", mtp_config_keys=("num_nextn_predict_layers",))
    r = inspect_checkpoint(str(strip_mtp(declared)))
    assert r.verdict == "no-mtp-heads" and codes(r) == ["mtp_stripped"]


@pytest.mark.parametrize("build", [build_qwen35_hybrid, build_qwen3_next])
def test_norms_shifted_twice_is_named_and_not_verified(tmp_path, build):
    r = inspect_checkpoint(str(apply_double_norm_shift(build(tmp_path / "m"))))
    assert r.verdict == "incompatible" and r.exit_code == 1
    assert "norms_shifted_twice" in codes(r)
    p = next(p for p in r.problems if p.code == "norms_shifted_twice")
    assert p.message.startswith("norms shifted twice") and "[C,1,K]" in p.message
    assert r.engines == []


def test_qwen3_dense_is_ar_only(dense):
    r = inspect_checkpoint(str(dense))
    assert r.verdict == "ar-only" and r.exit_code == 0 and r.problems == []
    assert r.mtp["declared"] == r.mtp["present"] == 0
    assert engines(r) == {"mlx_plain": ["none"], "mlx_dflash": ["dflash"], "mlx_dspark": ["dspark"],
                          "mlx_ngram": ["ngram"]}  # n-gram drafting needs nothing but the model
    assert r.memory.kv_cache_bytes_per_1k_tokens == 4 * 2 * 32 * 2 * 4 * 1024
    assert r.memory.recurrent_state_bytes is None


def test_mlx_converted_checkpoint(hybrid, tmp_path):
    """mlx-lm's own conversion: conv1d moved, norms +1, mtp.* dropped, 4-bit."""
    from mlx_lm import convert

    src = build_qwen35_hybrid(tmp_path / "src")  # convert needs the tokenizer
    convert(str(src), mlx_path=str(tmp_path / "mlx"), quantize=True, q_group_size=32, q_bits=4)
    r = inspect_checkpoint(str(tmp_path / "mlx"))
    assert r.layout == "mlx" and r.norms["conv1d_shape"][-1] == 1
    assert r.verdict == "no-mtp-heads" and codes(r) == ["mtp_stripped"]  # norms are fine
    assert r.quantization["bits"] == 4 and r.quantization["group_size"] == 32
    # Packed uint32 weights count as the parameters they hold.
    trunk = inspect_checkpoint(str(hybrid))
    assert r.params == trunk.params - sum(
        np.prod(s) for s in _mtp_shapes(hybrid))
    assert r.memory.weights_bytes < trunk.memory.weights_bytes / 3


def _mtp_shapes(path: Path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return [f.get_slice(k).get_shape() for k in f.keys() if k.startswith("mtp.")]


def test_mtp_sidecar_on_an_mlx_conversion(tmp_path):
    """An mlx conversion with the head put back as model-mtp.safetensors."""
    import mlx.core as mx
    from mlx_lm import convert

    src = build_qwen35_hybrid(tmp_path / "src")
    convert(str(src), mlx_path=str(tmp_path / "mlx"))
    head = {k: v for k, v in mx.load(str(src / "model.safetensors")).items() if k.startswith("mtp.")}
    norm = ("norm.weight", "layernorm.weight")
    shifted = {k: (v + 1.0 if k.endswith(norm) else v) for k, v in head.items()}
    mx.save_safetensors(str(tmp_path / "mlx" / "model-mtp.safetensors"), shifted)
    r = inspect_checkpoint(str(tmp_path / "mlx"))
    assert r.mtp["sidecar"] == "model-mtp.safetensors" and r.mtp["present"] == 1
    assert r.verdict == "family-compatible" and codes(r) == ["mtp_mlx_layout"]
    # The same head left zero-centred beside an mlx trunk: named, not verified.
    mx.save_safetensors(str(tmp_path / "mlx" / "model-mtp.safetensors"), head)
    r = inspect_checkpoint(str(tmp_path / "mlx"))
    assert "mtp_norms_not_shifted" in codes(r) and r.verdict == "family-compatible"


def test_unsupported_architecture(tmp_path, dense):
    _copy(dense, tmp_path / "m", model_type="not_a_model")
    r = inspect_checkpoint(str(tmp_path / "m"))
    assert r.verdict == "incompatible" and codes(r) == ["unsupported_architecture"]


def test_corrupt_and_incomplete_checkpoints(tmp_path, dense):
    bad = _copy(dense, tmp_path / "corrupt")
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    r = inspect_checkpoint(str(bad))
    assert r.verdict == "incompatible" and codes(r) == ["unreadable"]
    assert r.format == "unreadable" and r.exit_code == 1

    partial = _copy(dense, tmp_path / "partial")
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (partial / "model.safetensors.index.json").write_text(json.dumps(index))
    r = inspect_checkpoint(str(partial))
    assert r.verdict == "incompatible" and codes(r) == ["incomplete"]
    assert "model-00002-of-00002.safetensors" in r.problems[0].message


def _copy(src: Path, dest: Path, **config) -> Path:
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dest / "config.json").read_text()) | config
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# ---------------------------------------------------------------- tokenizers


def test_no_tokenizer_is_incompatible(tmp_path):
    # transformers would build an empty tokenizer here: every prompt encodes to nothing.
    r = inspect_checkpoint(str(build_qwen35_hybrid(tmp_path / "m", tokenizer=False)))
    assert r.verdict == "incompatible" and codes(r) == ["no_tokenizer"] and r.engines == []
    assert "tokenizer.json / tokenizer_config.json missing" in r.problems[0].message
    assert "tokenizer files" in r.problems[0].action


def test_no_chat_template_serves_completions_only(hybrid, tmp_path):
    m = _copy(hybrid, tmp_path / "m")
    tcfg = json.loads((m / "tokenizer_config.json").read_text())
    template = tcfg.pop("chat_template")
    (m / "tokenizer_config.json").write_text(json.dumps(tcfg))
    r = inspect_checkpoint(str(m))
    assert r.verdict == "family-compatible" and codes(r) == ["no_chat_template"]
    assert "/v1/completions" in r.problems[0].message and "mlx_plain" in engines(r)
    # Newer transformers save the template beside the config: that counts.
    (m / "chat_template.jinja").write_text(template)
    assert inspect_checkpoint(str(m)).verdict == "verified"


def test_unusable_tokenizers(dense, tmp_path):
    broken = _copy(dense, tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"model": ')
    r = inspect_checkpoint(str(broken))
    assert r.verdict == "incompatible" and codes(r) == ["tokenizer_unreadable"]
    # A tokenizer whose ids run past the embedding (vocab 2048 on a 1024 model).
    small = build_qwen3_dense(tmp_path / "small", vocab_size=1024, tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (small / f).write_bytes((dense / f).read_bytes())
    r = inspect_checkpoint(str(small))
    assert r.verdict == "incompatible" and codes(r) == ["tokenizer_vocab"]
    assert "ids up to 2047" in r.problems[0].message and "vocab_size 1024" in r.problems[0].message


# ---------------------------------------------------------------- drafters


def test_dflash_drafter_with_its_target_is_verified(tmp_path, dense):
    drafter = build_dflash_drafter(tmp_path / "dflash", target=dense, tokenizer=False)
    r = inspect_checkpoint(str(drafter), target=str(dense))
    assert r.kind == "drafter" and r.verdict == "verified", render_text(r)
    assert r.drafter["kind"] == "dflash" and r.drafter["target_hidden_size"] == 128
    assert engines(r) == {"mlx_dflash": ["dflash"]}
    assert r.target["hidden_size"] == 128 and r.target["verdict"] == "ar-only"


def test_dflash_drafter_with_the_wrong_target_is_incompatible(tmp_path, dense):
    drafter = build_dflash_drafter(tmp_path / "dflash", target=dense, tokenizer=False)
    other = build_qwen3_dense(tmp_path / "other", hidden_size=64, vocab_size=1024,
                              num_hidden_layers=6)
    r = inspect_checkpoint(str(drafter), target=str(other))
    assert r.verdict == "incompatible" and r.engines == []
    assert codes(r) == ["target_hidden_size", "target_vocab", "target_layers"]
    assert r.problems[0].message == "DFlash drafter expects target hidden size 128, the target has 64"
    # A config naming more target layers than fc was trained on.
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    (drafter / "config.json").write_text(json.dumps(cfg))
    r = inspect_checkpoint(str(drafter))
    assert r.verdict == "incompatible" and codes(r) == ["no_fc"]


def test_dspark_drafter_is_family_compatible(tmp_path, dense):
    # Its published file layout is UNCONFIRMED: never "verified".
    assert LAYOUT_CONFIRMED["build_dspark_drafter"] is False
    for name, kw in {"dspark": {}, "dspark0": {"markov_rank": 0,
                                               "enable_confidence_head": False}}.items():
        drafter = build_dspark_drafter(tmp_path / name, target=dense, tokenizer=False, **kw)
        r = inspect_checkpoint(str(drafter), target=str(dense))
        assert r.drafter["kind"] == "dspark" and r.verdict == "family-compatible"
        assert codes(r) == ["dspark_layout_unconfirmed"] and r.exit_code == 0
        assert engines(r) == {"mlx_dspark": ["dspark"]}


def test_gemma4_assistant(tmp_path, dense):
    drafter = build_gemma4_assistant(tmp_path / "g", target_hidden_size=128, tokenizer=False)
    r = inspect_checkpoint(str(drafter))
    assert r.verdict == "verified" and r.drafter["target_hidden_size"] == 128
    assert engines(r) == {"mlx_assistant": ["gemma4_assistant"]}
    assert r.memory.kv_cache_bytes_per_1k_tokens == 0
    r = inspect_checkpoint(str(drafter), target=str(dense))
    assert r.verdict == "incompatible" and codes(r) == ["target_family"]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> Path:
    return build_gemma4(tmp_path_factory.mktemp("gemma4") / "target")


def test_gemma4_target_and_its_assistant(tmp_path, gemma4):
    r = inspect_checkpoint(str(gemma4))
    assert r.verdict == "ar-only" and codes(r) == [] and r.family.startswith("Gemma-4")
    assert engines(r)["mlx_assistant"] == ["gemma4_assistant"]
    drafter = build_gemma4_assistant(tmp_path / "a", target=gemma4, tokenizer=False)
    r = inspect_checkpoint(str(drafter), target=str(gemma4))
    assert r.verdict == "verified" and codes(r) == []
    assert any("matches the drafter" in n for n in r.notes)


def test_gemma4_assistant_for_another_size_is_incompatible(tmp_path, gemma4):
    other = build_gemma4(tmp_path / "other", hidden_size=96, head_dim=16, tokenizer=False)
    drafter = build_gemma4_assistant(tmp_path / "a", target=other, tokenizer=False)
    r = inspect_checkpoint(str(drafter), target=str(gemma4))
    assert r.verdict == "incompatible"
    assert codes(r) == ["target_attention", "target_hidden_size"]
    text = render_text(r)
    assert "target hidden size 96, the target has 128" in text
    assert "head_dim is 16, the target's 32" in text


@pytest.mark.parametrize("which", ["assistant", "target"])
def test_gemma4_norms_stored_for_one_plus_weight_are_flagged(tmp_path, gemma4, which):
    """A port that stores Gemma-4's norms for a (1 + w) RMSNorm (w - 1, near 0)."""
    if which == "assistant":
        path = build_gemma4_assistant(tmp_path / "a", target=gemma4, tokenizer=False)
    else:
        path = build_gemma4(tmp_path / "t")
    apply_gemma4_norm_shift(path)
    r = inspect_checkpoint(str(path))
    assert r.verdict == "incompatible" and codes(r) == ["norms_shifted"]
    assert "(1 + w) convention" in render_text(r)


def test_target_flag_on_a_target_is_a_usage_error(hybrid, dense):
    with pytest.raises(UsageError, match="not a drafter"):
        inspect_checkpoint(str(hybrid), target=str(dense))


# ---------------------------------------------------------------- GGUF


def write_gguf(path: Path, *, nextn: int = 1, heads_at: list[int] | None = None,
               arch: str = "qwen35", n_layer: int = 4, tokenizer: bool = True) -> Path:
    """A tiny GGUF laid out as llama.cpp's converter writes an MTP model:
    block_count counts the nextn blocks, whose extra tensors are blk.N.nextn.*."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer + nextn)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_full_attention_interval(4)
    w.add_vocab_size(256)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if tokenizer:  # llama.cpp reads the vocabulary from the file
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(256)])
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, np.float32))
    for b in heads_at if heads_at is not None else range(n_layer, n_layer + nextn):
        w.add_tensor(f"blk.{b}.nextn.eh_proj.weight", np.zeros((64, 128), np.float32))
        for n in ("enorm", "hnorm", "shared_head_norm"):
            w.add_tensor(f"blk.{b}.nextn.{n}.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_with_nextn_head_is_verified(tmp_path):
    r = inspect_checkpoint(str(write_gguf(tmp_path / "m.gguf")))
    assert r.format == "gguf" and r.verdict == "verified", render_text(r)
    assert r.gguf["arch"] == "qwen35" and r.gguf["nextn_blocks"] == [4]
    assert r.gguf["file_type"] == "ALL_F32" and r.num_hidden_layers == 4
    assert r.mtp["present"] == 1 and r.mtp["tensors"] == 4
    assert engines(r) == {"llamacpp": ["none", "llamacpp_mtp"], "llamacpp_ngram": ["llamacpp_ngram"]}


def test_gguf_traps(tmp_path):
    cases = {
        "stripped": ({"heads_at": []}, "no-mtp-heads", ["mtp_stripped"]),
        "plain": ({"nextn": 0}, "ar-only", []),
        "misplaced": ({"heads_at": [2]}, "incompatible", ["mtp_head_inconsistent"]),
        "two-heads": ({"nextn": 2}, "incompatible", ["mtp_layer_count"]),
        "unknown-arch": ({"nextn": 0, "arch": "not-an-arch"}, "incompatible",
                         ["unsupported_architecture"]),
        "no-tokenizer": ({"tokenizer": False}, "incompatible", ["no_tokenizer"]),
    }
    for name, (kw, verdict, problems) in cases.items():
        r = inspect_checkpoint(str(write_gguf(tmp_path / f"{name}.gguf", **kw)))
        assert (r.verdict, codes(r)) == (verdict, problems), name
    assert engines(inspect_checkpoint(str(tmp_path / "stripped.gguf"))) == {
        "llamacpp": ["none"], "llamacpp_ngram": ["llamacpp_ngram"]}  # any GGUF drafts n-grams


# ---------------------------------------------------------------- JSON and CLI


def test_json_shape(hybrid):
    d = json.loads(json.dumps(inspect_checkpoint(str(hybrid)).to_dict()))
    assert {"source", "path", "format", "kind", "verdict", "family", "model_type", "layout",
            "hidden_size", "vocab_size", "num_hidden_layers", "layer_types", "params",
            "bytes_by_dtype", "quantization", "mtp", "drafter", "norms", "gguf", "memory",
            "engines", "problems", "notes", "target"} <= d.keys()
    assert set(d["memory"]) >= {"weights_bytes", "mtp_head_bytes", "kv_cache_bytes_per_1k_tokens",
                                "recurrent_state_bytes"}
    assert d["engines"][0] == {"engine": "mlx_plain", "methods": ["none"], "note": ""}
    assert set(d["mtp"]) >= {"declared", "declared_key", "present", "prefix", "nbytes", "tensors"}


def specgate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specgate", "inspect", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {}))


def test_cli_exit_codes(hybrid, stripped, dense, tmp_path):
    ok = specgate(str(hybrid), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["verdict"] == "verified"
    bad = specgate(str(stripped))
    assert bad.returncode == 1 and "verdict      no-mtp-heads" in bad.stdout
    assert "[mtp_stripped] config declares 1 MTP layer" in bad.stdout
    assert specgate(str(tmp_path / "missing")).returncode == 2
    misuse = specgate(str(hybrid), "--target", str(dense))
    assert misuse.returncode == 2 and "not a drafter" in misuse.stderr
    assert specgate("--no-such-flag", str(hybrid)).returncode == 2


def test_builtin_names_as_serve_takes_them(tmp_path):
    env = {"SPECGATE_HOME": str(tmp_path / "home")}
    demo = specgate("builtin:demo", "--json", env=env)
    assert demo.returncode == 0, demo.stderr
    assert json.loads(demo.stdout)["verdict"] == "verified"
    assert json.loads(demo.stdout)["source"] == "builtin:demo"
    drafter = specgate("builtin:demo-dflash", "--target", "builtin:demo", "--json", env=env)
    assert drafter.returncode == 0, drafter.stderr
    assert json.loads(drafter.stdout)["target"]["verdict"] == "verified"
    gguf = specgate("builtin:demo-gguf", "--json", env=env)  # exported on first use, as serve does
    assert gguf.returncode == 0, gguf.stderr
    assert json.loads(gguf.stdout)["format"] == "gguf"
    unknown = specgate("builtin:nope", env=env)
    assert unknown.returncode == 2 and "no such builtin model" in unknown.stderr
    assert "builtin:demo-dflash" in unknown.stderr


def test_hub_repo_ids_are_looked_up_in_the_local_cache_only(hybrid, tmp_path):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in hybrid.iterdir():  # weights, config and tokenizer, as the hub cache links them
        (snapshot / f.name).symlink_to(f)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    found = specgate("acme/tiny", "--json", env={"HF_HUB_CACHE": str(cache)})
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["path"] == str(snapshot)
    missing = specgate("acme/absent", env={"HF_HUB_CACHE": str(cache)})
    assert missing.returncode == 2 and "not downloaded" in missing.stderr
    assert "never downloads" in missing.stderr


def write_nextn_checkpoint(dest: Path, model_type: str, *, with_head: bool = True) -> Path:
    """DeepSeek-V3's layout in miniature: the MTP layer is model.layers.{N}."""
    from safetensors.numpy import save_file

    from specgate.builders.tokenizer import build_tokenizer

    h, n, vocab = 32, 2, 512
    dest.mkdir(parents=True)
    cfg = {"model_type": model_type, "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": h,
           "num_hidden_layers": n, "num_attention_heads": 2, "num_key_value_heads": 2,
           "vocab_size": vocab, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
           "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    (dest / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": np.zeros((vocab, h), np.float32),
         "model.norm.weight": np.ones(h, np.float32)}
    for i in range(n + (1 if with_head else 0)):
        t[f"model.layers.{i}.input_layernorm.weight"] = np.ones(h, np.float32)
    if with_head:
        t |= {f"model.layers.{n}.eh_proj.weight": np.zeros((h, 2 * h), np.float32),
              f"model.layers.{n}.enorm.weight": np.ones(h, np.float32),
              f"model.layers.{n}.hnorm.weight": np.ones(h, np.float32),
              f"model.layers.{n}.shared_head.norm.weight": np.ones(h, np.float32)}
    save_file(t, str(dest / "model.safetensors"))
    build_tokenizer(dest, vocab_size=vocab)
    return dest


def test_deepseek_nextn_layer(tmp_path):
    r = inspect_checkpoint(str(write_nextn_checkpoint(tmp_path / "v3", "deepseek_v3")))
    assert r.verdict == "verified", render_text(r)
    assert r.mtp["style"] == "nextn" and r.mtp["prefix"] == "model.layers.2."
    assert r.mtp["tensors"] == 5 and "mlx_mtp" in engines(r)
    # MLA: the latent (16) and the rope key (8) per layer, bfloat16.
    assert r.memory.kv_cache_bytes_per_1k_tokens == 2 * (16 + 8) * 2 * 1024
    r = inspect_checkpoint(str(write_nextn_checkpoint(tmp_path / "glm", "glm4_moe")))
    assert r.verdict == "family-compatible" and codes(r) == ["family_unconfirmed"]
    r = inspect_checkpoint(str(write_nextn_checkpoint(tmp_path / "cut", "deepseek_v3",
                                                      with_head=False)))
    assert r.verdict == "no-mtp-heads" and "model.layers.{N}" in r.problems[0].message
