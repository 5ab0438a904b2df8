"""Config: the shipped example loads; bad configs fail at start, saying where and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specgate.gateway.config import BUILTIN_DEMO, ConfigError, default_config, load_config

REPO = Path(__file__).resolve().parents[1]


def test_example_config_loads():
    config = load_config(REPO / "deploy/examples/specgate.yaml")
    assert config.server.host == "127.0.0.1"
    assert [m.id for m in config.models] == ["specgate-demo"]
    assert config.models[0].path == BUILTIN_DEMO


def test_example_config_documents_auth_and_admission():
    config = load_config(REPO / "deploy/examples/specgate.yaml")
    assert config.auth.keys_file is None and config.auth.metrics_requires_key is False
    assert config.models[0].max_queue_wait_s == 120


def test_keys_file_defaults_under_specgate_home(tmp_path, monkeypatch):
    from specgate.gateway.config import parse_config

    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    models = [{"id": "a", "path": "p"}]
    assert parse_config({"models": models}).auth.keys_path == tmp_path / "keys"
    named = parse_config({"auth": {"keys_file": "~/team-keys"}, "models": models})
    assert named.auth.keys_path == Path.home() / "team-keys"


def test_default_config_serves_the_demo_on_loopback():
    config = default_config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.models[0].path == BUILTIN_DEMO


def test_engines_default_by_format(tmp_path):
    from specgate.gateway.config import parse_config

    (tmp_path / "m.GGUF").touch()
    models = parse_config({"models": [{"id": "a", "path": str(tmp_path / "m.GGUF")},
                                      {"id": "b", "path": "d"},
                                      {"id": "c", "path": "builtin:demo-gguf"}]}).models
    assert [m.engines for m in models] == [["llamacpp"], ["mlx_plain"], ["llamacpp"]]


@pytest.mark.parametrize("text,needles", [
    ("models:\n  - id: a\n    path: p\n    max_concurrent: -1\n", ["models.0.max_concurrent", "greater than 0", "-1"]),
    ("models:\n  - id: a\n", ["models.0.path", "required"]),
    ("server:\n  port: 99999\nmodels:\n  - {id: a, path: p}\n", ["server.port", "99999"]),
    ("server:\n  prot: 80\nmodels:\n  - {id: a, path: p}\n", ["server.prot", "not permitted"]),
    ("models:\n  - {id: a, path: p}\n  - {id: a, path: q}\n", ["unique", "a"]),
    ("models:\n  - {id: a, path: p, engines: [warp]}\n", ["models.0.engines.0", "mlx_plain"]),
    ("models: {id: a}\n", ["models", "list"]),
    ("models:\n  - {id: a, path: m.gguf, engines: [mlx_mtp]}\n", ["models.0", "a GGUF file", "llamacpp"]),
    ("models:\n  - {id: a, path: dir, engines: [llamacpp_mtp]}\n", ["MLX", "mlx_plain"]),
    ("models:\n  - {id: a, path: m.gguf, engines: [llamacpp, llamacpp]}\n", ["twice"]),
    ("models:\n  - {id: a, path: m.gguf, llamacpp: {start: later}}\n", ["llamacpp.start", "boot"]),
    ("auth:\n  keys: x\nmodels:\n  - {id: a, path: p}\n", ["auth.keys", "not permitted"]),
    ("auth:\n  metrics_requires_key: maybe\nmodels:\n  - {id: a, path: p}\n",
     ["auth.metrics_requires_key", "boolean"]),
    ("models:\n  - {id: a, path: p, max_queue_wait_s: 0}\n", ["max_queue_wait_s", "greater than 0"]),
    ("prefix_cache:\n  ram_bytes: lots\nmodels:\n  - {id: a, path: p}\n",
     ["prefix_cache.ram_bytes", "64GiB", "75%"]),
    ("prefix_cache:\n  disk_bytes: -1\nmodels:\n  - {id: a, path: p}\n",
     ["prefix_cache.disk_bytes", "a size needs a unit", "or 0 for none"]),
    ("prefix_cache:\n  share: everyone\nmodels:\n  - {id: a, path: p}\n",
     ["prefix_cache.share", "'system', 'none' or 'all'"]),
    ("", ["empty"]),
    ("models: [\n", ["not valid YAML"]),
])
def test_bad_config_says_where(tmp_path, monkeypatch, text, needles):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").touch()  # there: these configs are wrong in other ways
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message


def test_cli_refuses_bad_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  - id: a\n")
    proc = subprocess.run([sys.executable, "-m", "specgate", "serve", "--config", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "models.0.path" in proc.stderr and str(path) in proc.stderr


# ---------------------------------------------------------------- paths that are not there


@pytest.mark.parametrize("entry,where,needles", [
    ({"path": "./models/qwen"}, "models.1.path", ["does not exist", "relative to the working "
                                                  "directory", "'./models/qwen'"]),
    ({"path": "../qwen"}, "models.1.path", ["does not exist", "'../qwen'"]),
    ({"path": "~/no-such-specgate-model"}, "models.1.path", ["does not exist", str(Path.home())]),
    ({"path": "ABS/none.gguf"}, "models.1.path", ["does not exist", "none.gguf"]),
    ({"path": "m.gguf"}, "models.1.path", ["does not exist", "'m.gguf'"]),  # a .gguf is a file
    ({"path": "models/qwen/v2"}, "models.1.path", ["does not exist"]),  # not org/name
    ({"path": "builtin:demo-dflash"}, "models.1.path", ["no such builtin", "builtin:demo-gguf"]),
    ({"path": "builtin:dmeo"}, "models.1.path", ["no such builtin", "builtin:demo"]),
    ({"path": "builtin:demo", "engines": ["mlx_plain", "mlx_dflash"], "drafter": "./drafters/x"},
     "models.1.drafter", ["does not exist", "'./drafters/x'"]),
    # A drafter is never a hub repo id: it is read from a local directory.
    ({"path": "builtin:demo", "engines": ["mlx_plain", "mlx_dflash"], "drafter": "z-lab/x"},
     "models.1.drafter", ["does not exist", "must be a local directory"]),
    ({"path": "builtin:demo", "engines": ["mlx_plain", "mlx_dflash"], "drafter": "builtin:demo"},
     "models.1.drafter", ["no such builtin", "builtin:demo-dflash"]),
])
def test_a_path_that_is_not_there_fails_at_start(tmp_path, monkeypatch, entry, where, needles):
    monkeypatch.chdir(tmp_path)
    entry = {k: v.replace("ABS", str(tmp_path)) if isinstance(v, str) else v
             for k, v in entry.items()}
    path = tmp_path / "specgate.yaml"
    path.write_text(yaml.safe_dump({"models": [{"id": "ok", "path": "builtin:demo"},
                                               {"id": "bad", **entry}]}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {where}: "), message
    for needle in needles:
        assert needle in message, message
    assert len(message.splitlines()) == 1  # the one entry that is wrong, nothing else


def test_paths_that_are_there_and_hub_ids_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    (tmp_path / "m.gguf").touch()
    models = [{"id": "a", "path": "./local"}, {"id": "b", "path": str(tmp_path / "local")},
              {"id": "c", "path": "m.gguf"},
              # Hub repo ids (and legacy bare names) are looked up when the model loads.
              {"id": "d", "path": "Qwen/Qwen3.5-0.8B"}, {"id": "e", "path": "gpt2"},
              {"id": "f", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_dflash"],
               "drafter": "local"},
              {"id": "g", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_dflash"],
               "drafter": "builtin:demo-dflash"}]
    from specgate.gateway.config import parse_config

    assert [m.id for m in parse_config({"models": models}).models] == list("abcdefg")


def test_cli_refuses_a_missing_model_before_loading(tmp_path):
    path = tmp_path / "specgate.yaml"
    missing = tmp_path / "models" / "qwen"
    path.write_text(yaml.safe_dump({"models": [{"id": "demo", "path": "builtin:demo"},
                                               {"id": "q", "path": str(missing)}]}))
    proc = subprocess.run([sys.executable, "-m", "specgate", "serve", "--config", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "specgate: bad config", f"{path}: models.1.path: does not exist (got '{missing}')"]


def test_llamacpp_ngram_type_is_one_llama_server_has():
    from specgate.engines.llamacpp.process import NGRAM_TYPES
    from specgate.engines.settings import LlamaCppNgramSettings
    from specgate.gateway.config import parse_config

    model = {"id": "g", "path": "builtin:demo-gguf", "engines": ["llamacpp", "llamacpp_ngram"]}
    ok = parse_config({"models": [model | {"llamacpp_ngram": {"type": "ngram-mod", "depth": 4}}]})
    assert ok.models[0].engine_settings() == {
        "llamacpp_ngram": LlamaCppNgramSettings(type="ngram-mod", depth=4)}
    with pytest.raises(ConfigError, match="llamacpp_ngram.type: Input should be 'ngram-simple', "
                                          "'ngram-map-k'"):
        parse_config({"models": [model | {"llamacpp_ngram": {"type": "ngram-cache"}}]})
    # The settings' types are the ones llama-server runs with.
    assert LlamaCppNgramSettings.model_fields["type"].annotation.__args__ == NGRAM_TYPES


def test_each_engine_takes_its_own_settings_and_older_keys_still_work():
    from specgate.engines.settings import (
        BlockSettings,
        LlamaCppNgramSettings,
        MTPNgramSettings,
        MTPSettings,
        NgramSettings,
    )
    from specgate.gateway.config import parse_config

    mlx = {"id": "m", "path": "builtin:demo", "drafter": "builtin:demo-dflash",
           "engines": ["mlx_plain", "mlx_mtp", "mlx_dflash", "mlx_ngram", "mlx_mtp_ngram"]}
    got = parse_config({"models": [mlx | {"mlx_mtp": {"depth": 3}, "mlx_ngram": {"depth": 12}}]})
    assert got.models[0].engine_settings() == {
        "mlx_mtp": MTPSettings(depth=3), "mlx_dflash": BlockSettings(),
        "mlx_ngram": NgramSettings(depth=12), "mlx_mtp_ngram": MTPNgramSettings()}
    # The keys that once sat on the model go to the listed engines they set;
    # an engine's own key wins over them.
    got = parse_config({"models": [mlx | {"mtp_depth": 4, "block_depth": 6, "ngram_depth": 10,
                                          "mlx_ngram": {"depth": 5}}]})
    assert got.models[0].engine_settings() == {
        "mlx_mtp": MTPSettings(depth=4), "mlx_dflash": BlockSettings(depth=6),
        "mlx_ngram": NgramSettings(depth=5), "mlx_mtp_ngram": MTPNgramSettings(depth=10, mtp_depth=4)}
    gguf = {"id": "g", "path": "builtin:demo-gguf", "engines": ["llamacpp", "llamacpp_mtp",
                                                                "llamacpp_ngram"]}
    got = parse_config({"models": [gguf | {"mtp_depth": 3, "ngram_depth": 6,
                                           "llamacpp": {"ngram_type": "ngram-mod", "threads": 2}}]})
    assert got.models[0].engine_settings() == {
        "llamacpp_mtp": MTPSettings(depth=3),
        "llamacpp_ngram": LlamaCppNgramSettings(depth=6, type="ngram-mod")}
    assert got.models[0].llamacpp.threads == 2
    # Settings for an engine the model does not list are a mistake worth a word.
    with pytest.raises(ConfigError, match="settings for mlx_ngram, which `engines` does not list"):
        parse_config({"models": [{"id": "m", "path": "builtin:demo", "mlx_ngram": {"depth": 3}}]})
    with pytest.raises(ConfigError, match=r"models.0.mlx_mtp.depht: Extra inputs"):
        parse_config({"models": [mlx | {"mlx_mtp": {"depht": 3}}]})


def test_prefix_cache_sizes_take_units():
    from specgate.gateway.config import parse_config

    models = [{"id": "a", "path": "org/name"}]
    pc = parse_config({"prefix_cache": {"ram_bytes": "1.5GiB", "disk_bytes": "512 MB"},
                       "models": models}).prefix_cache  # fmt: skip
    assert (pc.ram_bytes, pc.disk_bytes) == (3 << 29, 512 << 20)
    assert parse_config({"prefix_cache": {"disk_bytes": 0}, "models": models}).prefix_cache.disk_bytes == 0
