"""The config's JSON Schema (for editors) says what the validator says.

deploy/specgate.schema.json is generated from the pydantic models
(`specgate config schema`); this keeps the shipped file in step and checks
that the schema and the real validation agree on configs either side of
the line.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest
import yaml

from specgate.gateway.config import ConfigError, json_schema, parse_config
from specgate.gateway.operator.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "deploy" / "specgate.schema.json"
EXAMPLE = ROOT / "deploy" / "examples" / "specgate.yaml"


def test_the_shipped_schema_is_the_generated_one():
    assert json.loads(SHIPPED.read_text()) == json_schema(), (
        "deploy/specgate.schema.json is stale: `specgate config schema > deploy/specgate.schema.json`")


def test_the_example_names_the_schema_for_editors_and_passes_it():
    text = EXAMPLE.read_text()
    first = text.splitlines()[0]
    assert first == "# yaml-language-server: $schema=../specgate.schema.json"
    assert (EXAMPLE.parent / first.split("=", 1)[1]).resolve() == SHIPPED
    jsonschema_rs.validate(json.loads(SHIPPED.read_text()), yaml.safe_load(text))


GOOD = [
    {"models": [{"id": "m", "path": "builtin:demo"}]},
    {"prefix_cache": {"ram_bytes": "1GiB", "disk_bytes": 0, "share": "none"},
     "models": [{"id": "m", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_ngram"]}]},
    {"prefix_cache": {"disk_bytes": "512 MiB"}, "server": {"port": 9000, "log_level": "debug"},
     "models": [{"id": "g", "path": "builtin:demo-gguf", "llamacpp": {"idle_ttl_s": 60}}]},
    {"server": {"memory_budget": "50%"}, "prefix_cache": {"ram_bytes": "2%"},
     "models": [{"id": "g", "path": "builtin:demo-gguf", "llamacpp": {"idle_ttl_s": 60}}]},
    {"peers": [{"name": "mac2", "url": "http://10.0.0.2:8000", "key": "sg-x"}]},  # a front only
    # each engine's own settings, and the older model-level keys they replace
    {"models": [{"id": "m", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp", "mlx_ngram"],
                 "mlx_mtp": {"depth": 3}, "ngram_depth": 6}]},
]
BAD = [
    {},  # no models
    {"models": []},
    {"models": [], "peers": []},
    {"peers": [{"name": "mac2", "url": "10.0.0.2:8000"}]},  # no scheme
    {"models": [{"id": "m", "path": "builtin:demo", "enignes": ["mlx_plain"]}]},  # a typo
    {"models": [{"id": "m", "path": "builtin:demo", "engines": ["mlx_warp"]}]},
    {"server": {"port": 70000}, "models": [{"id": "m", "path": "builtin:demo"}]},
    {"server": {"log_level": "loud"}, "models": [{"id": "m", "path": "builtin:demo"}]},
    {"prefix_cache": {"ram_bytes": "lots"}, "models": [{"id": "m", "path": "builtin:demo"}]},
    {"prefix_cache": {"disk_bytes": -1}, "models": [{"id": "m", "path": "builtin:demo"}]},
    {"server": {"memory_budget": 96}, "models": [{"id": "m", "path": "builtin:demo"}]},  # no unit
    {"prefix_cache": {"disk_bytes": "5%"}, "models": [{"id": "m", "path": "builtin:demo"}]},  # of disk?
    {"models": [{"id": "has space", "path": "builtin:demo"}]},
]


@pytest.mark.parametrize("config", GOOD)
def test_what_validates_passes_the_schema(config):
    parse_config(config)
    jsonschema_rs.validate(json_schema(), config)


@pytest.mark.parametrize("config", BAD)
def test_what_the_schema_refuses_the_server_refuses(config):
    assert not jsonschema_rs.is_valid(json_schema(), config)
    with pytest.raises(ConfigError):
        parse_config(config)


def test_config_check_and_schema_commands(tmp_path, capsys):
    assert main(["config", "check", str(EXAMPLE)]) == 0
    assert "ok (1 model" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - id: m\n    path: builtin:demo\n    engines: [mlx_plain, mlx_mtp]\n"
                   "    mlx_mtp: {depth: 99}\n")
    assert main(["config", "check", str(bad)]) == 2
    assert f"{bad}: models.0.mlx_mtp.depth: Input should be less than or equal to 8" in capsys.readouterr().err
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()
