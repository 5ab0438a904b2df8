"""Config: the shipped example loads; bad configs fail at start, saying where and why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import BUILTIN_DEMO, ConfigError, default_config, load_config

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
    from gateway.config import parse_config

    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    models = [{"id": "a", "path": "p"}]
    assert parse_config({"models": models}).auth.keys_path == tmp_path / "keys"
    named = parse_config({"auth": {"keys_file": "~/team-keys"}, "models": models})
    assert named.auth.keys_path == Path.home() / "team-keys"


def test_default_config_serves_the_demo_on_loopback():
    config = default_config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.models[0].path == BUILTIN_DEMO


def test_engines_default_by_format():
    from gateway.config import parse_config

    models = parse_config({"models": [{"id": "a", "path": "x/m.GGUF"}, {"id": "b", "path": "d"},
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
    ("", ["empty"]),
    ("models: [\n", ["not valid YAML"]),
])
def test_bad_config_says_where(tmp_path, text, needles):
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
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "models.0.path" in proc.stderr and str(path) in proc.stderr
