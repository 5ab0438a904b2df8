"""Three kinds of engine in one gateway (an MLX model decoding plainly, the
demo model's MTP engine, a GGUF model on llama-server): a frozen
llama-server shows in /ready within seconds, and SIGTERM with streams open
on all three ends every stream with an error event and the process within
one grace period, not one grace per engine.

Real parts throughout: `specgate serve`, specgate's own llama-server build,
httpx streams. The one injected fault is SIGSTOP (a real llama-server,
frozen by the kernel). The module's gateway is shared: the SIGTERM test
ends it, so it comes last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from specgate.builders.gguf_export import export_gguf
from specgate.gateway.server import CLOSE_WAIT_S  # after the drain, for the last bytes to go out
from tests.conftest import start_gateway, stop_gateway
from tests.test_llamacpp_faults import frozen
from tests.test_llamacpp_gateway import llama_servers
from tests.test_llamacpp_process import gone

pytestmark = pytest.mark.timeout(600)

GRACE_S = 3.0
# Margins, not speed checks: what they tell apart is a one-grace exit (about
# GRACE_S) from one grace per engine (llama-server alone waited 10 s more
# after its SIGTERM), and a health check that reports the first missed
# answer (1 to 3 s) from one that waits for three misses (13 s or more).
EXIT_MARGIN_S = 4.0
NOTICED_S = 8.0


@pytest.fixture(scope="module")
def three(tiny_model, llama_server_binary, tmp_path_factory):
    root = tmp_path_factory.mktemp("three-engines")
    gguf = export_gguf(tiny_model, root / "tiny.gguf", include_mtp=False)
    gw = start_gateway({
        "server": {"shutdown_grace_s": GRACE_S},
        "llama_server": {"binary": str(llama_server_binary)},
        "models": [
            {"id": "tiny", "path": str(tiny_model), "max_concurrent": 4, "max_context": 8192},
            {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"],
             "mlx_mtp": {"depth": 2}},
            # Default health-check settings: those are what is tested.
            {"id": "gguf", "path": str(gguf), "max_concurrent": 4, "max_context": 8192,
             "llamacpp": {"threads": 1}},
        ],
    }, root)  # fmt: skip
    yield gw
    stop_gateway(gw)


def ready(gw) -> httpx.Response:
    return httpx.get(gw.base_url + "/ready", timeout=10)


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_frozen_llama_server_shows_in_ready_within_seconds_and_recovers(three):
    wait_until(lambda: ready(three).status_code == 200, 60, "/ready")
    (pid,) = llama_servers(three.process.pid).values()
    with frozen(pid):
        t0 = time.monotonic()
        while (r := ready(three)).status_code == 200:
            took = time.monotonic() - t0
            assert took < NOTICED_S, f"/ready said ready {took:.1f} s into a frozen llama-server"
            time.sleep(0.1)
        body = r.json()  # an open loopback server: anyone sees what an admin sees
        assert body["models"]["gguf"] == "unhealthy", body
        assert "did not answer /health" in body["errors"]["gguf"], body
        assert set(body["errors"]) == {"gguf"}, body
    # Thawed (or killed and restarted, had the thaw come late): ready again, and serving.
    wait_until(lambda: ready(three).status_code == 200, 60, "/ready after SIGCONT")
    r = httpx.post(three.api + "/completions", timeout=60, json={
        "model": "gguf", "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


# (model, path, X-Specgate-Method): ten streams over the three kinds of engine.
STREAMS = [
    *[("tiny", "/completions", None)] * 2,
    ("tiny", "/chat/completions", None),
    ("demo", "/completions", "mtp"),
    ("demo", "/completions", "none"),
    ("demo", "/chat/completions", "none"),
    *[("gguf", "/completions", None)] * 3,
    ("gguf", "/chat/completions", None),
]


def read_stream(gw, model: str, path: str, method: str | None, out: list,
                started: threading.Event) -> None:  # fmt: skip
    body = {"model": model, "max_tokens": 6000, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    body |= ({"prompt": "Once upon a time"} if path == "/completions"
             else {"messages": [{"role": "user", "content": "Tell a long story."}]})  # fmt: skip
    headers = {"X-Specgate-Method": method} if method else {}
    try:
        with httpx.stream("POST", gw.api + path, json=body, headers=headers, timeout=120) as r:
            if r.status_code != 200:
                out.append((r.status_code, r.read().decode()))
                return
            text = ""
            for chunk in r.iter_text():
                text += chunk
                if "data: " in text:
                    started.set()
            out.append((200, text))
    except httpx.HTTPError as e:
        out.append((0, repr(e)))
    finally:
        started.set()  # (a refusal too: the test then sees it)


def test_sigterm_with_three_engines_and_ten_streams_exits_within_one_grace(three):
    wait_until(lambda: ready(three).status_code == 200, 60, "/ready")
    results: list[list] = [[] for _ in STREAMS]
    started = [threading.Event() for _ in STREAMS]
    threads = [threading.Thread(target=read_stream, args=(three, *s, results[i], started[i]))
               for i, s in enumerate(STREAMS)]  # fmt: skip
    for t in threads:
        t.start()
    for (model, path, _), e in zip(STREAMS, started, strict=True):
        assert e.wait(120), f"a stream on {model} {path} did not start"
    pids = llama_servers(three.process.pid)
    t0 = time.monotonic()
    os.killpg(three.process.pid, signal.SIGTERM)
    bound = GRACE_S + CLOSE_WAIT_S + EXIT_MARGIN_S
    try:
        three.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit within 60 s of SIGTERM:\n{three.log()[-3000:]}") from None
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=30)
    for (model, path, method), out in zip(STREAMS, results, strict=True):
        status, text = out[0]
        assert status == 200, (model, path, out)
        events = [b.removeprefix("data: ") for b in text.split("\n\n") if b.strip()]
        assert events[-1] == "[DONE]", (model, path, method, text[-300:])
        last = json.loads(events[-2])
        assert last.get("error", {}).get("code") == "shutting_down", (model, path, method, last)
    assert took < bound, f"exited {took:.1f} s after SIGTERM; grace {GRACE_S:g} s"
    assert "Traceback" not in three.log()
    wait_until(lambda: all(gone(p) for p in pids.values()), 10, "llama-server to be gone")
