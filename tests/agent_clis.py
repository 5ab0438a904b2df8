"""The coding agents' own CLIs, from npm at pinned versions, for the agents tier.

The tests that drive a real agent (`-m agents`) install it here, once per run,
under the run's SPECGATE_HOME (`agent-clis/NAME-VERSION/`): `.ci/run` gives
each run an empty home, so the install itself is tested, and a developer's
home keeps the ~1.3 GB between runs. The product never installs these; users
install their agents themselves.

Each agent runs with a HOME of its own (`agent_env`), so neither a
developer's ~/.claude, ~/.codex or ~/.config/opencode nor their API keys
reach a test, and nothing the agent writes outlives it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class AgentCLI:
    package: str  # on npm
    version: str  # pinned: the versions issue 41 was reported against
    command: str  # the executable npm links into node_modules/.bin


AGENTS: dict[str, AgentCLI] = {
    "codex": AgentCLI("@openai/codex", "0.171.0", "codex"),
    "claude": AgentCLI("@anthropic-ai/claude-code", "2.1.332", "claude"),
    "opencode": AgentCLI("opencode-ai", "1.18.33", "opencode"),
    "qwen": AgentCLI("@qwen-code/qwen-code", "0.24.4", "qwen"),
    "continue": AgentCLI("@continuedev/cli", "1.5.47", "cn"),
}

INSTALL_TIMEOUT_S = 900  # ~20 s on a quiet line here; the registry may be slow


def agent_clis_dir(home: Path) -> Path:
    return home / "agent-clis"


def install(name: str, home: Path) -> Path:
    """The agent's executable, installed under `home` if it is not yet.

    One install at a time per home (a file lock: xdist workers share the run's
    home); a failed install leaves nothing that looks installed."""
    if shutil.which("npm") is None:
        pytest.skip("the agents tier needs Node.js and npm (Debian: nodejs, npm)")
    cli = AGENTS[name]
    root = agent_clis_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{cli.version}"
    exe = target / "node_modules" / ".bin" / cli.command
    with open(root / ".install.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".installed").is_file() and exe.exists():
            return exe
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        done = subprocess.run(
            ["npm", "install", "--prefix", str(target), f"{cli.package}@{cli.version}",
             "--no-audit", "--no-fund", "--no-update-notifier", "--loglevel=error"],
            capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
            env={**os.environ, "npm_config_cache": str(root / ".npm-cache")},
        )  # fmt: skip
        if done.returncode != 0 or not exe.exists():
            shutil.rmtree(target, ignore_errors=True)
            raise RuntimeError(
                f"npm install {cli.package}@{cli.version} failed (exit {done.returncode}):\n"
                f"{done.stderr[-4000:]}"
            )
        (target / ".installed").write_text(f"{cli.package}@{cli.version}\n")
        return exe


# Variables that would point an agent at a real provider or a developer's
# own settings; the tests set what they mean to.
_STRIPPED = ("OPENAI_", "ANTHROPIC_", "CLAUDE_", "CODEX_", "OPENCODE", "QWEN_", "DASHSCOPE_",
             "CONTINUE_", "XDG_", "NODE_OPTIONS")  # fmt: skip


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for one agent run: its own HOME (and XDG dirs under it),
    no provider keys or agent settings from the caller, no telemetry or
    update checks, and `extra` on top."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED)}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        NO_COLOR="1",
        CI="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    env.update(extra)
    return env
