"""`specgate launch AGENT --print-config`: what each agent is given, read from a real gateway.

The agents themselves run in the agents tier (tests/test_agent_clis.py),
with exactly what this prints; here, that it says what the gateway serves
(the model, its context from /v1/models) in each agent's own terms, in
lines a shell takes, and that launch fails with a clear word.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

CONTEXT = 4096


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    g = start_gateway({"models": [
        {"id": "tiny", "path": str(tiny_model), "max_context": CONTEXT, "engines": ["mlx_plain"]},
        {"id": "later", "path": str(tiny_model), "load": "on_demand"},
    ]}, tmp_path_factory.mktemp("launch"))  # fmt: skip
    yield g
    stop_gateway(g)


def launch(*args: str, home, path: str | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"SPECGATE_HOME": str(home)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "specgate", "launch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def parse_config(text: str) -> tuple[dict[str, str], dict[str, str], list[str], list[str]]:
    """--print-config's lines as (exports, files, unset names, command line),
    read as a shell reads them."""
    env, files, unset, command = {}, {}, [], []
    lines = iter(text.splitlines())
    for line in lines:
        if not line or line.startswith(("#", "mkdir -p ")):
            continue
        words = shlex.split(line)
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
        elif words[0] == "unset":
            unset.append(words[1])
        elif words[0] == "cat":  # cat > PATH <<'SPECGATE_EOF'
            body = []
            for inner in lines:
                if inner == "SPECGATE_EOF":
                    break
                body.append(inner)
            files[words[2]] = "\n".join(body) + "\n"
        else:
            command = words
    return env, files, unset, command


def test_models_say_their_context(gw):
    models = openai.OpenAI(base_url=gw.api, api_key="unused").models.list().data
    assert {m.id: m.context_length for m in models} == {"tiny": CONTEXT, "later": None}


def test_each_agent_gets_the_servers_model_and_context(gw, tmp_path):
    printed = {}
    for agent in ("claude", "codex", "opencode", "qwen"):
        done = launch(agent, "--print-config", "--url", gw.base_url, home=tmp_path)
        assert done.returncode == 0, done.stderr
        printed[agent] = parse_config(done.stdout)
        assert f"model tiny: context {CONTEXT} tokens, replies up to {CONTEXT // 4}" in done.stdout
        assert "no API keys" in done.stdout  # the placeholder key, said
    env, _, unset, command = printed["claude"]
    assert command == ["claude"] and unset == ["ANTHROPIC_API_KEY"]
    assert env["ANTHROPIC_BASE_URL"] == gw.base_url and env["ANTHROPIC_AUTH_TOKEN"]
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "tiny"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(CONTEXT)
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(CONTEXT // 4)

    env, _, _, command = printed["codex"]
    overrides = dict(c.split("=", 1) for c in command[2::2])
    assert command[0] == "codex" and set(command[1::2]) == {"-c"}
    assert overrides["model_provider"] == '"specgate"' and overrides["model"] == '"tiny"'
    assert overrides["model_context_window"] == str(CONTEXT)
    assert f'base_url = "{gw.api}"' in overrides["model_providers.specgate"]
    assert 'env_key = "SPECGATE_API_KEY"' in overrides["model_providers.specgate"]
    assert env == {"SPECGATE_API_KEY": printed["claude"][0]["ANTHROPIC_AUTH_TOKEN"]}

    env, _, _, command = printed["opencode"]
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["specgate"]
    assert command == ["opencode"] and config["model"] == "specgate/tiny"
    assert provider["options"]["baseURL"] == gw.api
    assert provider["models"]["tiny"]["limit"] == {"context": CONTEXT, "output": CONTEXT // 4}

    env, files, _, command = printed["qwen"]
    assert command == ["qwen", "--auth-type", "openai"]
    assert (env["OPENAI_BASE_URL"], env["OPENAI_MODEL"]) == (gw.api, "tiny")
    assert env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == str(CONTEXT // 4)
    settings = json.loads(files[env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"]])
    assert settings["model"]["generationConfig"]["contextWindowSize"] == CONTEXT
    # Its stream guards: a long prefill (keep-alives are comments to its SDK)
    # is not given up at 240 s and sent again.
    assert settings["model"]["generationConfig"]["streamIdleTimeoutMs"] == 3_600_000
    assert settings["model"]["generationConfig"]["streamMaxLifetimeMs"] == 0
    # Its background memory agents: a second full prefill per turn, off.
    assert settings["memory"] == {"enableManagedAutoMemory": False, "enableManagedAutoDream": False,
                                  "enableAutoSkill": False}  # fmt: skip
    assert env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"].startswith(str(tmp_path / "launch"))
    assert not (tmp_path / "launch").exists()  # printed, not written


def test_launch_says_what_is_wrong(gw, tmp_path):
    unknown = launch("claude", "--print-config", "--url", gw.base_url, "--model", "nope",
                     home=tmp_path)  # fmt: skip
    assert unknown.returncode == 2 and "'nope' is not served" in unknown.stderr
    assert "tiny, later" in unknown.stderr
    # A model not loaded yet: its context is unknown, and said so.
    later = launch(
        "qwen", "--print-config", "--url", gw.base_url, "--model", "later", home=tmp_path
    )
    assert later.returncode == 0 and "context unknown" in later.stdout
    assert "QWEN_CODE_MAX_OUTPUT_TOKENS" not in later.stdout
    assert "contextWindowSize" not in later.stdout
    # No server there: --print-config starts none.
    nobody = launch("claude", "--print-config", "--url", "http://127.0.0.1:9", home=tmp_path)
    assert nobody.returncode == 2 and "no specgate answers at http://127.0.0.1:9:" in nobody.stderr
    # ... nor does launch for a server named by --url: it may be another machine's.
    named = launch("claude", "--url", "http://127.0.0.1:9", "--", "-p", "hi", home=tmp_path)
    assert named.returncode == 2 and "no specgate answers" in named.stderr
    assert "started" not in named.stderr and not (tmp_path / "launch").exists()
    # The agent not installed: its npm line.
    missing = launch("opencode", "--url", gw.base_url, "--", "run", "hi", home=tmp_path,
                     path=os.path.dirname(sys.executable))  # fmt: skip
    assert missing.returncode == 2
    assert "npm install -g opencode-ai" in missing.stderr and "1.18.33" in missing.stderr


def test_a_busy_gateway_is_up_when_it_answers_late():
    """Failure injection: a stand-in for a gateway whose /health answers after
    4 s (a shared box busy with agents' turns). launch waits for it instead of
    saying that nothing answers."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from specgate.gateway.operator.launch import is_up

    class Late(BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(4)
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Late)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert is_up(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert not is_up("http://127.0.0.1:9")  # refused: nobody there, at once
