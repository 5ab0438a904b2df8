"""Models on demand under a memory budget, through a real server and the
openai SDK: loaded by their first request (concurrent ones wait for the
same load), unloaded after an idle TTL, the least recently used idle one
evicted when a third needs room (never one with a stream in flight), one
that could never fit refused with the sizes; /metrics, the admin API and
`specgate models` say so."""

from __future__ import annotations

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
    gw = start_gateway({"server": {"memory_budget": cache_ram + int(2.5 * one)},
                        "prefix_cache": {"ram_bytes": cache_ram}, "models": models},
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
