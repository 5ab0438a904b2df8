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


def test_default_config_serves_the_demo_on_loopback():
    config = default_config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.models[0].path == BUILTIN_DEMO


@pytest.mark.parametrize("text,needles", [
    ("models:\n  - id: a\n    path: p\n    max_concurrent: -1\n", ["models.0.max_concurrent", "greater than 0", "-1"]),
    ("models:\n  - id: a\n", ["models.0.path", "required"]),
    ("server:\n  port: 99999\nmodels:\n  - {id: a, path: p}\n", ["server.port", "99999"]),
    ("server:\n  prot: 80\nmodels:\n  - {id: a, path: p}\n", ["server.prot", "not permitted"]),
    ("models:\n  - {id: a, path: p}\n  - {id: a, path: q}\n", ["unique", "a"]),
    ("models:\n  - {id: a, path: p, engines: [warp]}\n", ["models.0.engines.0", "mlx_plain"]),
    ("models: {id: a}\n", ["models", "list"]),
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
