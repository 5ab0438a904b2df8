"""The `specgate` command: serve's defaults and its port, --help, --version."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib.metadata import version

import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.engines.checkpoints.builtin import DEFAULT_MODEL_ID


def test_serve_without_config_serves_the_demo(tmp_path):
    home = tmp_path / "home"
    gw = start_gateway(None, tmp_path, home=home)
    try:
        client = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_ID]
        out = client.completions.create(
            model=DEFAULT_MODEL_ID, prompt="import os\nimport sys\n\n\ndef main():\n",
            max_tokens=24, temperature=0)
        assert out.usage.completion_tokens >= 1
        # The trained model writes Python, not noise.
        assert out.choices[0].text.strip()
        assert "\ufffd" not in out.choices[0].text
    finally:
        stop_gateway(gw)
    assert f"listening on {gw.base_url}" in gw.log()  # uvicorn says nothing, given the socket
    assert not home.exists()  # nothing written: the model ships in the package


# `specgate serve` in this process: a thread waits until a chat completion is
# answered, then reports which of specgate's build-time modules were loaded.
_SERVE_PROBE = """
import json, os, sys, threading, time, urllib.request
from specgate.gateway.operator.cli import main

port = sys.argv[1]

def watch():
    body = json.dumps({"model": "specgate-demo", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                answered = json.load(r)["usage"]["completion_tokens"]
            break
        except OSError:
            time.sleep(0.2)
    else:
        answered = None
    loaded = sorted(m for m in sys.modules if m == "specgate.builders" or m.startswith("specgate.builders."))
    # One write, marked: the server's threads log to the same stderr meanwhile.
    sys.stderr.write("PROBE-REPORT " + json.dumps({"answered": answered, "builders": loaded}) + "\\n")
    sys.stderr.flush()
    os._exit(0)

threading.Thread(target=watch, daemon=True).start()
main(["serve", "--host", "127.0.0.1", "--port", port])
"""


def test_serve_never_imports_the_builders(tmp_path):
    """Trainers, fixtures and GGUF export (specgate/builders/) are build-time
    code: serving the demo model, a chat completion answered, loads none."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"SPECGATE_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-c", _SERVE_PROBE, str(port)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    # (ci13: an access-log line landed on the report's line; the marker finds it wherever it is.)
    at = proc.stderr.rfind("PROBE-REPORT ")
    assert at >= 0, proc.stderr[-3000:]
    report, _ = json.JSONDecoder().raw_decode(proc.stderr, at + len("PROBE-REPORT "))
    assert report["answered"], proc.stderr[-3000:]
    assert report["builders"] == [], f"specgate serve imported {report['builders']}"


# ---------------------------------------------------------------- --help, --version

HEAVY = ("mlx", "mlx_lm", "transformers", "torch", "numpy", "tokenizers", "huggingface_hub",
         "safetensors", "gguf")
COMMANDS = [[], ["serve"], ["keys"], ["keys", "add"], ["keys", "list"], ["inspect"],
            ["demo-model"], ["demo-drafter"], ["tune"], ["install-llama-server"]]

# Runs main(argv) in a fresh interpreter; prints its exit code and the heavy
# top-level packages it imported.
_PROBE = """
import json, sys
from specgate.gateway.operator.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.stdin.read())))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=REPO, input=json.dumps(HEAVY),
                          capture_output=True, text=True, timeout=60)
    return proc, json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "specgate")
def test_help_imports_no_heavy_module(command):
    proc, probe = _probe(*command, "--help")
    assert probe == {"code": 0, "heavy": []}, probe
    assert "usage: specgate" in proc.stdout


def test_demo_trainers_keep_their_options():
    # The options moved out of the trainers: the trainers still read them.
    from specgate.builders.training_args import DrafterConfig, TrainConfig

    proc, _ = _probe("demo-model", "--help")
    assert "--steps STEPS" in proc.stdout and "--size {default,large,tiny}" in proc.stdout
    proc, _ = _probe("demo-drafter", "--help")
    assert "--target-layers I,J,..." in proc.stdout and "--mask-token-id" in proc.stdout
    assert TrainConfig().steps == 3000 and DrafterConfig().target_layer_ids == [1, 3, 5, 6]


def test_version():
    proc, probe = _probe("--version")
    assert probe == {"code": 0, "heavy": []}
    assert proc.stdout.strip() == f"specgate {version('specgate-llm')}"  # the distribution's name


# ---------------------------------------------------------------- serve: the port

def test_port_in_use_is_one_line_and_exit_3(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "specgate", "serve", "--port", str(port)], cwd=REPO,
            capture_output=True, text=True, timeout=120,
            env=os.environ | {"SPECGATE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 3
    # Before anything loads (no uvicorn startup, no model loader thread), and
    # nothing else: no uvicorn log, no traceback.
    assert proc.stderr.splitlines() == [
        f"specgate: cannot listen on 127.0.0.1:{port}: address already in use "
        "(stop what uses it, or pick another --port)"]
    assert proc.stdout == ""


# ---------------------------------------------------------------- tune: what is not there


@pytest.mark.parametrize("model,needle", [
    ("builtin:nope", "builtin:nope: no such builtin model (there are builtin:demo"),
    ("/nonexistent/specgate-model", "/nonexistent/specgate-model does not exist"),
])
def test_tune_names_what_is_not_there(tmp_path, model, needle):
    proc = subprocess.run([sys.executable, "-m", "specgate", "tune", model], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=os.environ | {"SPECGATE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"specgate tune: {needle}") and "Traceback" not in proc.stderr
