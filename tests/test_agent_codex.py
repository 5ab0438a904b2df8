"""Codex CLI (the pinned one of tests/agent_clis.py) completes a turn against
a real gateway, configured with exactly what `specgate launch codex
--print-config` prints (a model provider with `wire_api = "responses"`, its
base_url and env_key, the model's context window), and once more with a
model catalog entry (tests/fixtures/agents/capture.py), as the README
describes for Codex's apply_patch.

The model is tests/tool_caller.py's XML-format lookup checkpoint (a chat
template with Qwen's tool-call format) whose greedy answer is a line of
text, so Codex's first request, with all its tools (function, namespace,
web_search; with the model catalog entry also apply_patch as a custom Lark
tool, whose grammar then holds the output), is served and answered.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from agent_clis import agent_env
from conftest import start_gateway, stop_gateway
from fixtures.agents.capture import codex_catalog, codex_config
from test_agent_clis import printed_config
from tool_caller import XML_TEMPLATE, build_tool_caller

pytestmark = pytest.mark.agents

ANSWER = "Hello from specgate."
MODEL = "local-coder"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    path = build_tool_caller(tmp_path_factory.mktemp("codex-model"), XML_TEMPLATE, ANSWER)
    gw = start_gateway({"models": [{"id": MODEL, "path": str(path), "max_context": 32768}]},
                       tmp_path_factory.mktemp("codex-gateway"))  # fmt: skip
    yield gw
    stop_gateway(gw)


@pytest.mark.parametrize("catalog", [False, True], ids=["plain", "model-catalog"])
def test_codex_exec_completes_a_turn(gateway, agent_cli, tmp_path, catalog):
    codex = agent_cli("codex")
    if catalog:
        env = {"SPECGATE_API_KEY": "sk-local"}
        args = codex_config(gateway.api, MODEL)
        args += ["-c", f'model_catalog_json="{codex_catalog(tmp_path / "catalog.json", MODEL)}"']
    else:
        env, files, unset, command = printed_config("codex", gateway.base_url,
                                                    tmp_path / "sg-home")  # fmt: skip
        assert not files and command[0] == "codex"
        args = command[1:]
    (tmp_path / "work").mkdir()
    log_before = len(gateway.log())
    done = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "--ephemeral", *args,
         "-C", str(tmp_path / "work"), "Say hello."],
        env=agent_env(tmp_path / "home", **env),
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ANSWER, (done.stdout, done.stderr[-3000:])
    # A request's access line is written once its handler returns, after the
    # stream's last bytes: Codex may exit before it is in the log (seen in CI).
    deadline = time.monotonic() + 15
    while True:
        log = gateway.log()[log_before:]
        requests = re.findall(r"specgate\.access: .* method=(?:GET|POST) path=(\S+) .* status=(\d{3}) ", log)
        if ("/v1/responses", "200") in requests or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ("/v1/responses", "200") in requests, log[-3000:]
    assert not [r for r in requests if r[1].startswith("4")], requests
