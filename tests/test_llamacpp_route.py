"""The llama.cpp route's pieces that need no running llama-server: each
slot's context against the trained one, the n-gram lookup length, the KV a
sliding-window GGUF holds, the memory estimate, the chat_template setting.
(tests/test_llamacpp_real_model.py runs them on the real SmolLM2 GGUF.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specgate.engines.checkpoints.inspect import inspect_checkpoint
from specgate.engines.llamacpp.build import build_llamacpp_engines, read_gguf_facts, slot_context
from specgate.engines.llamacpp.process import ServerSpec
from specgate.engines.settings import (
    NGRAM_LOOKUP_DEFAULT,
    LlamaCppNgramSettings,
    LlamaServerSettings,
    MTPSettings,
)
from specgate.gateway.config import ConfigError, load_config
from specgate.gateway.serving.footprint import estimate


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def per_slot(args: list[str]) -> int:
    """Each slot's context as llama.cpp sizes it from -c and -np: both
    rounded up to a multiple of 256 (llama_context's constructor)."""
    pad = lambda n: -(-n // 256) * 256  # noqa: E731
    return pad(pad(int(flag(args, "-c"))) // int(flag(args, "-np")))


def build(model: Path, engines: list[str], **kw):
    settings = {"llamacpp_ngram": LlamaCppNgramSettings(), "llamacpp_mtp": MTPSettings()}
    return build_llamacpp_engines("m", model, engines, settings=settings,
                                  server=LlamaServerSettings(), binary=None,
                                  max_queue=0, **{"max_context": None, "max_concurrent": 1} | kw)


# -- each slot's context --------------------------------------------------------


def test_slot_context_is_never_past_the_trained_context():
    assert slot_context(100, 8192) == (256, 100)
    assert slot_context(8192, 8192) == (8192, 8192 - 16)  # llama.cpp's 8208 -> 8448 would be past it
    assert slot_context(32768, 8192) == (8192, 8176)
    assert slot_context(8192, None) == (8448, 8192)  # no trained length known: as asked
    assert slot_context(1000, 1000) == (768, 752)  # rounded down to what llama.cpp keeps


def test_smollm2_slots_hold_at_most_its_trained_context(smollm2_gguf):
    """-c 65664 -np 8 made 8,448-token slots of a model trained on 8,192."""
    facts = read_gguf_facts(smollm2_gguf)
    assert facts.context_length == 8192
    for max_context in (8192, None):
        built, _ = build(smollm2_gguf, ["llamacpp"], max_context=max_context, max_concurrent=8)
        engine = built["llamacpp"]
        args = engine.server.spec.args(0)
        assert flag(args, "-np") == "8"
        assert per_slot(args) == 8192, args
        assert engine.max_context <= 8192 - 16
    small, _ = build(smollm2_gguf, ["llamacpp"], max_context=1000, max_concurrent=2)
    assert small["llamacpp"].max_context == 1000 and per_slot(small["llamacpp"].server.spec.args(0)) == 1024


# -- n-gram drafting ---------------------------------------------------------------


def test_ngram_lookup_length_is_passed(smollm2_gguf):
    built, _ = build(smollm2_gguf, ["llamacpp", "llamacpp_ngram"])
    args = built["llamacpp_ngram"].server.spec.args(0)
    kind = flag(args, "--spec-type")
    assert kind == LlamaCppNgramSettings().type
    assert kind == "ngram-map-k4v"  # the measured winner (engines/settings.py)
    lookup = "--spec-ngram-map-k4v-size-n"
    # llama.cpp's own (12; ngram-mod's 24) drafted nothing on a code copy (issue 42).
    assert flag(args, lookup) == str(NGRAM_LOOKUP_DEFAULT) and NGRAM_LOOKUP_DEFAULT < 12
    assert "--spec-type" not in built["llamacpp"].server.spec.args(0)
    for kind, name in (("ngram-simple", "--spec-ngram-simple-size-n"),
                       ("ngram-map-k4v", "--spec-ngram-map-k4v-size-n"),
                       ("ngram-mod", "--spec-ngram-mod-n-match")):  # fmt: skip
        args = ServerSpec(Path("m.gguf"), spec={"type": kind, "n_max": 8, "lookup": 3}).args(0)
        assert flag(args, name) == "3"
    with pytest.raises(ValueError):
        LlamaCppNgramSettings(lookup=0)


# -- the KV a sliding-window GGUF holds --------------------------------------------


def write_swa_gguf(path: Path, arch: str, *, layers: int = 6, window: int | None = 512,
                   pattern: int | list[bool] | None = None) -> Path:  # fmt: skip
    """A tiny GGUF of a sliding-window family: 2 KV heads of 16 dims."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    if window is not None:
        w.add_sliding_window(window)
    if isinstance(pattern, int):
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", pattern)
    elif pattern is not None:
        w.add_array(f"{arch}.attention.sliding_window_pattern", pattern)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(256)])
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


PER_TOKEN_LAYER = 2 * 2 * 16 * 2  # K and V x 2 heads x 16 dims x f16


@pytest.mark.parametrize(("arch", "kw", "windowed"), [
    ("gemma2", {}, 3),  # every other layer, llama.cpp's gemma2 default
    ("gemma2", {"window": None}, 3),  # ... with its default window, 4096
    ("gemma3", {}, 5),  # 5 of every 6
    ("gemma3", {"pattern": 3}, 4),  # the file's period: layers 2 and 5 attend fully
    ("gemma3", {"pattern": [True, False, True, True, False, True]}, 4),  # the file's bools
    ("gemma3", {"window": None}, 0),  # gemma3 without a window attends fully
    ("gemma4", {"pattern": [True, True, False, True, True, False]}, 4),
    ("llama", {}, 0),  # not a sliding-window family
])  # fmt: skip
def test_sliding_window_layers_hold_only_their_window(tmp_path, arch, kw, windowed):
    r = inspect_checkpoint(str(write_swa_gguf(tmp_path / "m.gguf", arch, **kw)))
    full = 6 - windowed
    assert r.layer_types.get("sliding_attention", 0) == windowed, r.layer_types
    assert r.layer_types["full_attention"] == full
    assert r.memory.kv_cache_bytes_per_1k_tokens == full * PER_TOKEN_LAYER * 1024
    window = 4096 if kw.get("window", 512) is None else 512
    assert (r.memory.sliding_kv_bytes or 0) == windowed * PER_TOKEN_LAYER * window
    if arch == "gemma4":  # no window in the file: counted nowhere, and said so, not a crash
        r = inspect_checkpoint(str(write_swa_gguf(tmp_path / "w.gguf", arch, window=None, **kw)))
        assert r.memory.sliding_kv_bytes is None
        assert any("not counted" in a for a in r.memory.assumptions)


def test_smollm2_kv_estimate(smollm2_gguf, tmp_path):
    """SmolLM2: no key_length in the file (head size = 576 / 9 = 64, as llama.cpp takes it)."""
    r = inspect_checkpoint(str(smollm2_gguf))
    per_token = 30 * 2 * 3 * 64 * 2  # layers x (K, V) x kv heads x head dim x f16
    assert r.memory.kv_cache_bytes_per_1k_tokens == per_token * 1024
    built, _ = build(smollm2_gguf, ["llamacpp"], max_context=1000, max_concurrent=2)
    assert built["llamacpp"]._kv_bytes == per_token * 1024 * 2
    assert built["llamacpp"]._weights_bytes == sum(t.n_bytes for t in gguf.GGUFReader(smollm2_gguf).tensors)
    assert built["llamacpp"].memory() == []  # nothing runs yet, nothing held
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models:\n  - id: smol\n    path: {smollm2_gguf}\n    max_context: 1000\n"
                   "    max_concurrent: 2\n    engines: [llamacpp, llamacpp_ngram]\n")
    est = estimate(load_config(cfg).models[0])
    assert est.kv_reserve == per_token * 1024 * 2 * 2  # 2 slots of 1024 tokens, 2 processes


# -- chat_template -----------------------------------------------------------------


def test_chat_template_setting(tmp_path, smollm2_gguf):
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")

    def model(template: str) -> dict:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"models:\n  - id: smol\n    path: {smollm2_gguf}\n    chat_template: '{template}'\n")
        return load_config(cfg).models[0]

    assert model(str(jinja)).chat_template_text() == jinja.read_text()
    inline = "{{ messages[0].content }}"
    assert model(inline).chat_template_text() == inline
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        model(str(tmp_path / "missing.jinja"))
