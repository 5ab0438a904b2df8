"""Models on demand under a memory budget, through a real server and the
openai SDK: loaded by their first request (concurrent ones wait for the
same load), unloaded after an idle TTL, the least recently used idle one
evicted when a third needs room (never one with a stream in flight), one
that could never fit refused with the sizes; /metrics, the admin API and
`specgate models` say so. A model whose load fails does not hold /ready
while another serves, says why, and is tried again until it loads."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.gateway.config import ModelConfig
from specgate.gateway.operator.cli import main
from specgate.gateway.serving.footprint import estimate

MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory):
    """a, b, c: three tiny models of which two fit; huge: one that never
    does; brief: unloaded after 2 s idle."""
    root = tmp_path_factory.mktemp("lifecycle")
    paths = {n: build_qwen35_hybrid(root / n, seed=i) for i, n in enumerate("abc")}
    one = estimate(ModelConfig(id="a", path=str(paths["a"]), max_context=MAX_CONTEXT,
                               max_concurrent=2)).total  # fmt: skip
    cache_ram = 1 << 20
    models = [{"id": n, "path": str(p), "load": "on_demand", "max_context": MAX_CONTEXT,
               "max_concurrent": 2} for n, p in paths.items()]  # fmt: skip
    models += [
        {"id": "huge", "path": str(paths["a"]), "load": "on_demand", "max_context": 1 << 20,
         "max_concurrent": 64},
        {"id": "brief", "path": str(paths["b"]), "load": "on_demand", "idle_ttl_s": 2,
         "max_context": 256, "max_concurrent": 1},
    ]
    gw = start_gateway({"server": {"memory_budget": f"{cache_ram + int(2.5 * one)}B"},
                        "prefix_cache": {"ram_bytes": f"{cache_ram}B"}, "models": models},
                       root)  # fmt: skip
    gw.one = one
    yield gw
    stop_gateway(gw)


def states(gw) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(gw.base_url + "/admin/models").json()["models"]}


def metric(gw, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(gw.base_url + "/metrics").text.splitlines():
        if line.startswith(f"{name}{{"):
            series, value = line.rsplit(" ", 1)
            got = ",".join(sorted(series[len(name) + 1 : -1].split(",")))
            if got == want:
                return float(value)
    return None


def ask(gw, model: str) -> str:
    c = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=3, temperature=0)  # fmt: skip
    return r.choices[0].finish_reason


def test_models_load_on_first_use_and_the_least_recently_used_idle_one_makes_room(budgeted):
    gw = budgeted
    assert set(states(gw).values()) == {"unloaded"}  # nothing loaded at start, yet ready
    assert httpx.get(gw.base_url + "/ready").status_code == 200

    # Two requests at once for an unloaded model: one load, both answered.
    results = []
    threads = [threading.Thread(target=lambda: results.append(ask(gw, "a"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and states(gw)["a"] == "ready"
    assert metric(gw, "specgate_model_loads_total", model="a", result="ok") == 1
    assert metric(gw, "specgate_model_state", model="a", state="ready") == 1
    assert metric(gw, "specgate_model_memory_bytes", model="a", kind="weights") > 0

    ask(gw, "b")
    assert states(gw)["a"] == states(gw)["b"] == "ready"

    # b streams while a is asked again (a is now the most recent), then c
    # needs room: b is the least recently used, but busy; a goes.
    with httpx.stream("POST", gw.api + "/chat/completions", timeout=120, json={
            "model": "b", "messages": [{"role": "user", "content": "count"}], "max_tokens": 1900,
            "temperature": 0, "stream": True, "ignore_eos": True}) as stream:  # fmt: skip
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        ask(gw, "a")
        ask(gw, "c")
        s = states(gw)
        assert (s["a"], s["b"], s["c"]) == ("unloaded", "ready", "ready"), s
        tail = [line for line in lines if line.startswith("data: ")]
    assert tail[-1] == "data: [DONE]" and '"finish_reason":"length"' in tail[-2].replace(" ", "")
    assert metric(gw, "specgate_model_unloads_total", model="a", reason="evicted") == 1

    # a again: c is idle and older than b now.
    ask(gw, "b")
    ask(gw, "a")
    s = states(gw)
    assert (s["a"], s["b"], s["c"]) == ("ready", "ready", "unloaded"), s


def test_a_model_that_can_never_fit_is_refused_with_the_sizes(budgeted):
    with pytest.raises(openai.InternalServerError) as err:
        ask(budgeted, "huge")
    message = err.value.message
    assert err.value.status_code == 503 and "needs about" in message and "KV reserve" in message
    assert "GiB" in message and "server.memory_budget" in message
    assert states(budgeted)["huge"] == "failed"
    assert metric(budgeted, "specgate_model_loads_total", model="huge", result="failed") == 1
    ask(budgeted, "a")  # the others serve on


def test_an_idle_model_unloads_after_its_ttl(budgeted):
    gw = budgeted
    ask(gw, "brief")
    assert states(gw)["brief"] == "ready"
    deadline = time.monotonic() + 30
    while states(gw)["brief"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert states(gw)["brief"] == "unloaded"
    assert metric(gw, "specgate_model_unloads_total", model="brief", reason="idle") == 1
    ask(gw, "brief")  # and loads again when asked
    assert metric(gw, "specgate_model_loads_total", model="brief", result="ok") == 2


def test_the_operator_cli_lists_loads_and_unloads(budgeted, capsys):
    gw = budgeted
    assert main(["load", "c", "--url", gw.base_url]) == 0
    assert main(["models", "--url", gw.base_url]) == 0
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:] if line.strip()
             and not line.startswith(("memory:", "errors:", " "))}  # fmt: skip
    assert table["c"] == "ready" and table["huge"] == "failed" and "GiB of" in out
    assert main(["unload", "c", "--url", gw.base_url]) == 0
    assert main(["ps", "--url", gw.base_url]) == 0
    out = capsys.readouterr().out
    assert "c: unloaded" in out and "\nc " not in out.split("c: unloaded", 1)[1]
    assert main(["load", "nope", "--url", gw.base_url]) == 1
    assert "404" in capsys.readouterr().err
    # Residency while it serves: pinned, then a TTL, then neither.
    assert main(["pin", "c", "--url", gw.base_url]) == 0
    assert main(["ttl", "c", "90", "--url", gw.base_url]) == 0
    out = capsys.readouterr().out
    assert "c: pinned, no idle unload" in out and "c: pinned, unloads after 90 s idle" in out
    assert main(["unpin", "c", "--url", gw.base_url]) == 0
    assert main(["ttl", "c", "none", "--url", gw.base_url]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("c: not pinned, no idle unload")
    with pytest.raises(SystemExit):  # argparse: seconds above 0, or "none"
        main(["ttl", "c", "-5", "--url", gw.base_url])


# -- a model that fails to load ------------------------------------------------------------


@pytest.fixture(scope="module")
def with_broken(tiny_model, tmp_path_factory):
    """good serves; broken (loaded at start) and broken-on-demand (at its
    first request) are copies of it whose weights file was cut short, as an
    incomplete download leaves it (the one fault injected here)."""
    root = tmp_path_factory.mktemp("broken-models")
    models = [{"id": "good", "path": str(tiny_model), "max_context": MAX_CONTEXT,
               "max_concurrent": 2}]  # fmt: skip
    for name, load in (("broken", "boot"), ("broken-on-demand", "on_demand")):
        copy = shutil.copytree(tiny_model, root / name)
        weights = copy / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        models.append({"id": name, "path": str(copy), "load": load, "max_context": MAX_CONTEXT,
                       "max_concurrent": 2})  # fmt: skip
    gw = start_gateway({"server": {"load_retry_min_s": 1, "load_retry_max_s": 2}, "models": models},
                       root)  # fmt: skip
    gw.root, gw.tiny = root, tiny_model
    yield gw
    stop_gateway(gw)


def listed(gw) -> dict[str, dict]:
    return {m["id"]: m["specgate"] for m in httpx.get(gw.api + "/models").json()["data"]}


def wait_for(cond, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_failed_load_leaves_the_node_ready_says_why_and_is_retried_until_it_loads(with_broken):
    gw = with_broken
    # The others serve: the node is ready, whatever the broken model does.
    assert httpx.get(gw.base_url + "/ready").status_code == 200
    assert ask(gw, "good") == "length"
    with pytest.raises(openai.InternalServerError) as err:
        ask(gw, "broken-on-demand")
    assert err.value.status_code == 503 and "safetensors" in err.value.message
    assert httpx.get(gw.base_url + "/ready").status_code == 200

    # Why, in /v1/models (what a request for it is told too), /admin/status and /metrics.
    # (A retry may be under way at any moment: "loading" then, the reason kept.)
    for name in ("broken", "broken-on-demand"):
        entry = listed(gw)[name]
        assert entry["state"] in ("failed", "loading") and "safetensors" in entry["error"], entry
        status = {m["id"]: m for m in httpx.get(gw.base_url + "/admin/status").json()["models"]}
        assert status[name]["error"] == entry["error"] and status[name]["failures"] >= 1
        assert metric(gw, "specgate_model_loads_total", model=name, result="failed") >= 1
        assert metric(gw, "specgate_model_failed_loads_in_a_row", model=name) >= 1
    assert "error" not in listed(gw)["good"]
    wait_for(lambda: metric(gw, "specgate_model_state", model="broken", state="failed") == 1,
             "the state gauge to say failed")  # fmt: skip

    # The file repaired, no admin: the boot model is tried again by itself,
    # the on-demand one by the next request once its wait is over.
    for name in ("broken", "broken-on-demand"):
        shutil.copy(gw.tiny / "model.safetensors", gw.root / name / "model.safetensors")
    wait_for(lambda: states(gw)["broken"] == "ready", "the boot model to load")
    assert ask(gw, "broken") == "length"

    def on_demand_serves() -> bool:
        try:
            return ask(gw, "broken-on-demand") == "length"
        except openai.InternalServerError as e:  # still within its wait: the error, at once
            assert e.status_code == 503 and "safetensors" in e.message
            return False

    wait_for(on_demand_serves, "the on-demand model to load")
    for name in ("broken", "broken-on-demand"):
        assert "error" not in listed(gw)[name] and listed(gw)[name]["state"] == "ready"
        assert metric(gw, "specgate_model_failed_loads_in_a_row", model=name) == 0
        assert metric(gw, "specgate_model_loads_total", model=name, result="ok") == 1
    assert httpx.get(gw.base_url + "/ready").status_code == 200
