"""Real coding agents complete a turn against a real gateway serving the demo model.

The agents tier (`-m agents`): each agent's CLI from npm at its pinned
version (tests/agent_clis.py), in a HOME of its own, configured with
exactly what `specgate launch AGENT --print-config` prints, run
non-interactively with its default settings (all its tools, thinking as it
asks): exit 0, the model's reply on stdout, and no 4xx in the gateway's
log. Then `specgate launch` itself runs one, and makes and keeps a key for
it where the server needs keys.

The demo writes Python-shaped noise and ends a reply at a blank line (its
reply_stop). What each agent sends (measured here, 2 cores shared): Claude
Code ~17.5k prompt tokens (12 tools, max_tokens the launch cap of 8192),
OpenCode a title request and then ~10k (10 tools), Qwen Code ~20k (10
tools; its background memory agents, another ~15k each, off as launch
sets them); the demo prefills ~400-500 tokens/s on this CPU (float32 through
OpenBLAS: kernels/cpu_blas.py; ~100-300 in bfloat16), so each agent's first
turn takes one to two minutes here (ci14: 63-99 s, against 124-432 s). A later turn with the same system
prompt and tools reuses their prefill (the prefix cache), as the launch
test's Claude Code does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from agent_clis import AGENTS, agent_env
from conftest import REPO, reserved_ports, start_gateway, stop_gateway
from test_launch import parse_config

from specgate.gateway.access.keys import add_key, read_keys
from specgate.gateway.config import DEMO_REPLY_STOP

pytestmark = [pytest.mark.agents, pytest.mark.timeout(1200)]

AGENT_TIMEOUT_S = 900  # a cold ~20k-token prefill on a loaded 2-core machine took ~4 minutes
PROMPT = "What does hello.txt say?"
ARGS = {"claude": ["-p", PROMPT], "opencode": ["run", PROMPT], "qwen": ["-p", PROMPT]}
_REFUSED = re.compile(r"specgate\.access: .* status=[45]\d\d ")


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """The demo as `specgate serve` serves it by default (its reply stop
    included), plain decoding only: on a CPU the MTP engine only adds load."""
    g = start_gateway({"models": [{"id": "specgate-demo", "path": "builtin:demo",
                                   "engines": ["mlx_plain"],
                                   "reply_stop": list(DEMO_REPLY_STOP)}]},
                      tmp_path_factory.mktemp("agents-gw"))  # fmt: skip
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """One project and one HOME per agent for the module: Claude Code's system
    prompt names both, so the launch test's turn finds the first one's
    prefill in the prefix cache."""
    where = tmp_path_factory.mktemp("project")
    (where / "hello.txt").write_text("hello from the agents tier\n")
    return where


@pytest.fixture(scope="module")
def homes(tmp_path_factory):
    return tmp_path_factory.mktemp("homes")


def printed_config(agent: str, url: str, home) -> tuple[dict, dict, list, list]:
    done = subprocess.run(
        [sys.executable, "-m", "specgate", "launch", agent, "--print-config", "--url", url],
        cwd=REPO, env=os.environ | {"SPECGATE_HOME": str(home)}, capture_output=True, text=True,
        timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return parse_config(done.stdout)


def _refusals(log: str) -> list[str]:
    return [line for line in log.splitlines() if _REFUSED.search(line)]


SERVED = re.compile(r"method=POST path=/v1/(messages|chat/completions) .* status=200 outcome=ok")


def _log_after(gw, seen: int, timeout: float = 15.0) -> str:
    """The gateway's log since `seen`, once it holds a served turn's access
    line: a request's line is written as its last byte goes out, and an
    agent may exit on that byte before the gateway, under load, logs it
    (ci33: an empty log after a turn that answered)."""
    deadline = time.monotonic() + timeout
    while not SERVED.search(log := gw.log()[seen:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return log


@pytest.mark.parametrize("agent", list(ARGS))
def test_agent_completes_a_turn(agent, gw, agent_cli, project, homes, tmp_path):
    exe = agent_cli(agent)
    env, files, unset, command = printed_config(agent, gw.base_url, tmp_path / "sg-home")
    for path, text in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    run_env = agent_env(homes / agent, **env)
    for name in unset:
        run_env.pop(name, None)
    seen = len(gw.log())
    start = time.monotonic()
    done = subprocess.run([str(exe), *command[1:], *ARGS[agent]], cwd=project, env=run_env,
                          capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)  # fmt: skip
    took = time.monotonic() - start
    log = _log_after(gw, seen)
    print(f"\n{agent}: a turn in {took:.0f} s; stdout {done.stdout!r:.200}")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout.strip(), done.stderr[-2000:]
    assert "API Error" not in done.stdout  # (Claude Code's words for a refused or cut reply)
    assert SERVED.search(log), log[-2000:]
    assert not _refusals(log), _refusals(log)
    if agent == "qwen":
        # One prompt for the turn: launch's settings keep its background
        # memory agents (a second, different full prefill per turn) off. The
        # same prompt sent again is Qwen Code's own retry of a reply it finds
        # invalid (an empty text from the tiny model, say), not such an agent.
        posts = re.findall(r"method=POST path=/v1/chat/completions .* prompt_tokens=(\d+)", log)
        assert posts and len(set(posts)) == 1, posts


def test_launch_runs_the_agent(gw, agent_cli, project, homes, tmp_path):
    """`specgate launch claude` itself: the running gateway found, Claude Code
    run with launch's settings, a turn completed."""
    exe = agent_cli("claude")
    env = agent_env(homes / "claude", SPECGATE_HOME=str(tmp_path / "sg-home"),
                    PATH=f"{exe.parent}{os.pathsep}{os.environ['PATH']}",
                    PYTHONPATH=str(REPO))  # fmt: skip
    seen = len(gw.log())
    done = subprocess.run([sys.executable, "-m", "specgate", "launch", "claude", "--url",
                           gw.base_url, "--", *ARGS["claude"]], cwd=project, env=env,
                          capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout.strip() and f"claude -> {gw.base_url}" in done.stderr
    log = _log_after(gw, seen)
    assert "method=POST path=/v1/messages " in log and not _refusals(log)


def test_launch_starts_a_server_and_keeps_a_key_for_the_agent(agent_cli, tmp_path):
    """No server at the config's port, and the keys file has keys: launch
    makes a key for the agent, starts the server (left running), and runs
    the agent; the next launch reuses the key."""
    exe = agent_cli("claude")
    home = tmp_path / "sg-home"
    keys = tmp_path / "keys"
    add_key(keys, "someone")
    port = reserved_ports()
    config = tmp_path / "specgate.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": port}, "auth": {"keys_file": str(keys)},
        "models": [{"id": "specgate-demo", "path": "builtin:demo", "engines": ["mlx_plain"]}]}))  # fmt: skip
    env = agent_env(tmp_path / "home", SPECGATE_HOME=str(home), PYTHONPATH=str(REPO),
                    PATH=f"{exe.parent}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    args = [sys.executable, "-m", "specgate", "launch", "claude", "--config", str(config)]
    done = subprocess.run([*args, "--", "--version"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    started = re.search(r"started `specgate serve` \(pid (\d+)", done.stderr)
    try:
        assert done.returncode == 0, done.stderr
        assert AGENTS["claude"].version in done.stdout  # the agent ran: `claude --version`
        assert started, done.stderr
        assert "added key 'launch-claude'" in done.stderr
        assert [r.name for r in read_keys(keys)] == ["someone", "launch-claude"]
        key = (home / "launch" / "keys" / "claude").read_text().strip()
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        again = subprocess.run([*args, "--print-config"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert parse_config(again.stdout)[0]["ANTHROPIC_AUTH_TOKEN"] == key
        assert "started" not in again.stderr and len(read_keys(keys)) == 2
    finally:
        if started:  # launch leaves it running, by design; this test stops it
            _stop(int(started.group(1)))


def _stop(pid: int) -> None:
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
