"""Sizes in the config take units, and the RAM ones a share of physical
memory; the prefix cache's RAM is a share of server.memory_budget (an
eighth by default), and /admin/models, /metrics and `specgate models` show
it. A bare number is refused: `memory_budget: 96` once meant 96 bytes."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from conftest import REPO, start_gateway, stop_gateway
from prometheus_client.parser import text_string_to_metric_families

from specgate.engines.memory import physical_memory
from specgate.gateway.config import ConfigError, load_config
from specgate.gateway.operator.cli import main

GIB = 1 << 30
NEEDS_UNIT = "a size needs a unit, like 64GiB or 512MiB, or a share of RAM like 75%"


def write(tmp_path, server: str = "", prefix_cache: str = ""):
    path = tmp_path / "specgate.yaml"
    text = "models:\n  - {id: a, path: org/name}\n"
    if server:
        text += f"server:\n  {server}\n"
    if prefix_cache:
        text += f"prefix_cache:\n  {prefix_cache}\n"
    path.write_text(text)
    return path


def test_config_check_refuses_a_bare_number_and_names_the_units(tmp_path):
    path = write(tmp_path, "memory_budget: 96")
    done = subprocess.run([sys.executable, "-m", "specgate", "config", "check", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == f"{path}: server.memory_budget: {NEEDS_UNIT} (got 96)"


@pytest.mark.parametrize(("server", "prefix_cache", "expected"), [
    ("memory_budget: '96'", "", f"server.memory_budget: {NEEDS_UNIT} (got '96')"),
    ("", "ram_bytes: 1073741824", f"prefix_cache.ram_bytes: {NEEDS_UNIT} (got 1073741824)"),
    ("", "disk_bytes: 8", "prefix_cache.disk_bytes: a size needs a unit, like 64GiB or 512MiB, "
                          "or 0 for none (got 8)"),
    ("", "disk_bytes: 10%", "prefix_cache.disk_bytes: a size needs a unit"),  # a share of RAM only
    ("responses_store: {bytes_per_key: 4096}", "", "server.responses_store.bytes_per_key: a size needs"),
    ("max_body_bytes: 4194304", "", "server.max_body_bytes: a size needs a unit, like 64GiB or "
                                    "512MiB (got 4194304)"),
    ("max_header_bytes: 0KiB", "", "server.max_header_bytes: Input should be greater than 0"),
    ("memory_budget: 0%", "", "server.memory_budget: a share of RAM is more than 0% and at most 100%"),
    ("memory_budget: 120%", "", "server.memory_budget: a share of RAM is more than 0% and at most 100%"),
    ("memory_budget: 1GiB", "ram_bytes: 1GiB", "prefix_cache.ram_bytes 1.00 GiB leaves nothing of "
                                               "server.memory_budget 1.00 GiB for models"),
])  # fmt: skip
def test_what_is_refused_says_why(tmp_path, server, prefix_cache, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, server, prefix_cache))
    assert expected in str(err.value)


def test_units_and_shares_resolve_to_bytes(tmp_path):
    config = load_config(write(tmp_path, "memory_budget: 64GiB", "ram_bytes: 8 GiB\n  disk_bytes: 0"))
    assert (config.server.memory_budget, config.prefix_cache.ram_bytes) == (64 * GIB, 8 * GIB)
    assert config.prefix_cache.disk_bytes == 0
    assert load_config(write(tmp_path, "memory_budget: 2G")).server.memory_budget == 2 * GIB
    assert load_config(write(tmp_path, "memory_budget: 512MiB")).server.memory_budget == 512 << 20
    share = load_config(write(tmp_path, "memory_budget: 75%"))
    assert share.server.memory_budget == physical_memory() * 3 // 4
    assert load_config(write(tmp_path, prefix_cache="ram_bytes: 12.5%")).prefix_cache.ram_bytes == (
        physical_memory() // 8)
    limits = load_config(write(tmp_path, "max_body_bytes: 8MiB\n  max_header_bytes: 16KiB")).server
    assert (limits.max_body_bytes, limits.max_header_bytes) == (8 << 20, 16 << 10)


def test_the_prefix_cache_takes_an_eighth_of_the_budget_not_of_the_machine(tmp_path):
    budgets = load_config(write(tmp_path, "memory_budget: 1GiB")).budgets()
    assert (budgets.memory, budgets.prefix_cache, budgets.models) == (GIB, GIB // 8, GIB - GIB // 8)
    default = load_config(write(tmp_path)).budgets()
    assert default.memory == physical_memory() * 3 // 4 and default.prefix_cache == default.memory // 8


@pytest.fixture(scope="module")
def small_budget(tiny_model, tmp_path_factory):
    """A gateway with a 1 GiB budget and its model unloaded (nothing to load:
    the budget is what is shown)."""
    gw = start_gateway({"server": {"memory_budget": "1GiB"},
                        "models": [{"id": "tiny", "path": str(tiny_model), "load": "on_demand"}]},
                       tmp_path_factory.mktemp("budgets"))  # fmt: skip
    yield gw
    stop_gateway(gw)


def test_the_prefix_caches_share_is_shown(small_budget, capsys):
    gw = small_budget
    body = httpx.get(gw.base_url + "/admin/models").json()
    assert (body["memory_budget"], body["prefix_cache_budget"], body["models_budget"]) == (
        GIB, GIB // 8, GIB - GIB // 8)
    budget = {s.labels["scope"]: s.value for family in text_string_to_metric_families(
        httpx.get(gw.base_url + "/metrics").text) if family.name == "specgate_memory_budget_bytes"
        for s in family.samples}  # fmt: skip
    assert budget == {"server": GIB, "prefix_cache": GIB // 8, "models": GIB - GIB // 8}
    assert main(["models", "--url", gw.base_url]) == 0
    assert ("memory: 0.00 GiB of 0.88 GiB for models (server.memory_budget 1.00 GiB; "
            "prefix cache 0.12 GiB)") in capsys.readouterr().out


def test_a_reload_keeps_the_prefix_caches_ram_and_the_new_budget_must_hold_it(small_budget):
    gw = small_budget
    text = gw.config_path.read_text()
    try:
        gw.config_path.write_text(text.replace("memory_budget: 1GiB", "memory_budget: 100MiB"))
        r = httpx.post(gw.base_url + "/admin/reload", timeout=60)
        assert r.status_code == 400 and "server.memory_budget 0.10 GiB leaves nothing for models beside " \
            "the prefix cache's 0.12 GiB, whose size changes only at a restart" in r.json()["error"]["message"]
        gw.config_path.write_text(text.replace("memory_budget: 1GiB", "memory_budget: 2GiB"))
        r = httpx.post(gw.base_url + "/admin/reload", timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["restart_needed"] == ["prefix_cache.ram_bytes (an eighth of server.memory_budget)"]
        body = httpx.get(gw.base_url + "/admin/models").json()
        assert (body["memory_budget"], body["prefix_cache_budget"], body["models_budget"]) == (
            2 * GIB, GIB // 8, 2 * GIB - GIB // 8)
    finally:
        gw.config_path.write_text(text)
