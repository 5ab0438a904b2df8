"""`specgate launch AGENT`: a coding agent pointed at this machine's specgate.

Named after `ollama launch`. For Claude Code (`claude`), Codex CLI
(`codex`), OpenCode (`opencode`) and Qwen Code (`qwen`):

1. The gateway: the one answering /health at the config's host and port
   (`--url` to name another), else a `specgate serve` started here in the
   background, with the same `--config`. Launch waits for /ready, says so,
   and leaves it running when the agent exits: the next launch (and the
   prefix cache it filled) finds it there; its pid and log are printed.
2. The key: on a server with no API keys (the loopback default) none is
   needed and the agent gets a placeholder. With keys, launch keeps one per
   agent: a key named `launch-AGENT` in the keys file, its plaintext in
   $SPECGATE_HOME/launch/keys/AGENT (0600, as agents keep theirs), reused
   while the keys file still has it. A key made while a server already runs
   works after that server reloads its keys; launch says so and stops.
   `--key` uses a key of the caller's instead.
3. The model (`--model`, else the gateway's first) and its context, from
   /v1/models' `context_length`: agents that do not know a model guess its
   window (Claude Code 1M), compact too late and ask for more output than
   the context leaves. Replies are capped at a quarter of the context (at
   most 32000), so a prompt can grow to three quarters of it.
4. The agent's own configuration, never a file of the user's: environment
   variables and command-line overrides where the agent has them, and a
   file launch owns where it has none (Qwen Code's context window, and its
   background memory agents off, in a system-defaults file under
   $SPECGATE_HOME/launch/qwen/, which the user's own settings still
   override).
5. The agent itself, found on PATH (its npm install line if missing), in
   place of this process, with what follows `--` as its arguments.

`--print-config` prints steps 2-5 as shell lines a person can paste (or
copy into the agent's own files) and starts or writes nothing; it needs a
running gateway. tests/test_agent_clis.py runs each agent with exactly
what it prints. Only the standard library is imported at the top: the
parser reads AGENTS for `specgate --help`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

    from specgate.gateway.config import Config

OPEN_SERVER_KEY = "specgate"  # what an agent sends to a server that needs no key
READY_TIMEOUT_S = 600.0  # a started server's models load before it is ready
USER_AGENT = "specgate-launch"  # its own requests, told apart from the agent's
MAX_REPLY_TOKENS = 32000  # Claude Code's own default for a model it does not know


class LaunchError(Exception):
    """Why launch cannot go on; the message says what to do."""


@dataclass(frozen=True)
class Target:
    """Where the agent goes and what it may assume of the model there."""

    base_url: str  # the gateway's root, without /v1
    key: str
    model: str
    context: int | None  # prompt + reply tokens; None: the gateway does not know yet

    @property
    def reply_cap(self) -> int | None:
        return min(MAX_REPLY_TOKENS, self.context // 4) if self.context else None


@dataclass
class AgentConfig:
    """What the agent runs with: environment, leading arguments, files."""

    env: dict[str, str]
    unset: tuple[str, ...] = ()  # variables of the caller's that would point it elsewhere
    args: list[str] = field(default_factory=list)
    files: dict[Path, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Agent:
    name: str
    title: str
    command: str  # the executable npm installs
    package: str  # on npm
    tested: str  # the version specgate's tests run (tests/agent_clis.py)
    configure: Callable[[Target], AgentConfig]


def _claude(t: Target) -> AgentConfig:
    # Bearer auth (ANTHROPIC_AUTH_TOKEN): an API key would have Claude Code
    # ask, in a session, whether to use it. Every model alias and the
    # subagents name the one model, or background work asks for a Claude.
    env = {"ANTHROPIC_BASE_URL": t.base_url, "ANTHROPIC_AUTH_TOKEN": t.key,
           "ANTHROPIC_MODEL": t.model, "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
           "CLAUDE_CODE_SUBAGENT_MODEL": t.model}  # fmt: skip
    if t.context:
        # Its window for a model it does not recognize (it assumes 1M and
        # says so otherwise), and the cap on each reply's max_tokens.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(t.context)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(t.reply_cap)
    return AgentConfig(env, unset=("ANTHROPIC_API_KEY",))


def _codex(t: Target) -> AgentConfig:
    # A provider of its own (`-c` overrides: the user's config.toml stays as
    # it is), on the Responses API; the key from the variable it names.
    url = json.dumps(f"{t.base_url}/v1")  # a TOML basic string
    provider = (f'{{ name = "specgate", base_url = {url}, env_key = "SPECGATE_API_KEY", '
                f'wire_api = "responses" }}')  # fmt: skip
    args = ["-c", 'model_provider="specgate"', "-c", f"model_providers.specgate={provider}",
            "-c", f"model={json.dumps(t.model)}"]  # fmt: skip
    if t.context:
        args += ["-c", f"model_context_window={t.context}"]
    return AgentConfig({"SPECGATE_API_KEY": t.key}, args=args)


def _opencode(t: Target) -> AgentConfig:
    # OPENCODE_CONFIG_CONTENT is merged over the user's opencode.json.
    model: dict = {"name": t.model, "tool_call": True}
    if t.context:
        model["limit"] = {"context": t.context, "output": t.reply_cap}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"specgate": {
            "npm": "@ai-sdk/openai-compatible", "name": "specgate",
            "options": {"baseURL": f"{t.base_url}/v1", "apiKey": t.key},
            "models": {t.model: model}}},
        "model": f"specgate/{t.model}",
        "small_model": f"specgate/{t.model}",  # titles and summaries
    }  # fmt: skip
    return AgentConfig({"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


STREAM_IDLE_MS = 3_600_000  # Qwen Code's stream idle guard under launch (its own: 240 s)


def _qwen(t: Target) -> AgentConfig:
    from specgate.engines.home import launch_dir

    env = {"OPENAI_BASE_URL": f"{t.base_url}/v1", "OPENAI_API_KEY": t.key, "OPENAI_MODEL": t.model}
    # Launch's own settings go in a system-defaults file (the lowest layer:
    # the user's settings.json still wins). Its background memory agents
    # (extraction after every turn, consolidation, skill review) each send
    # the conversation again under a system prompt of their own, so nothing
    # of the turn's prefill is shared: on one local box that is a second
    # full prefill per turn (15k tokens in 0.24.4's, measured) queued beside
    # everyone's requests. Off unless the user turns them on.
    settings: dict = {"memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False,
                                 "enableAutoSkill": False}}  # fmt: skip
    # Its stream guards: a stream that sends no chunk for 4 minutes is given
    # up and the whole request sent again, and none may last 15. specgate's
    # keep-alives during a long prefill are SSE comments, which its SDK does
    # not count as chunks: a 250 s prefill on a busy CI box was cancelled
    # and retried. A local box's long prompt may take that long, and its
    # answer longer: the idle guard at an hour, the lifetime guard off.
    generation: dict = {"streamIdleTimeoutMs": STREAM_IDLE_MS, "streamMaxLifetimeMs": 0}
    if t.context:
        env["QWEN_CODE_MAX_OUTPUT_TOKENS"] = str(t.reply_cap)
        # The window has no variable either.
        generation["contextWindowSize"] = t.context
    settings["model"] = {"generationConfig": generation}
    defaults = launch_dir() / "qwen" / "system-defaults.json"
    env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"] = str(defaults)
    return AgentConfig(env, args=["--auth-type", "openai"],
                       files={defaults: json.dumps(settings, indent=2) + "\n"})


AGENTS = {a.name: a for a in (
    Agent("claude", "Claude Code", "claude", "@anthropic-ai/claude-code", "2.1.332", _claude),
    Agent("codex", "Codex CLI", "codex", "@openai/codex", "0.171.0", _codex),
    Agent("opencode", "OpenCode", "opencode", "opencode-ai", "1.18.33", _opencode),
    Agent("qwen", "Qwen Code", "qwen", "@qwen-code/qwen-code", "0.24.4", _qwen),
)}  # fmt: skip


# -- the gateway ------------------------------------------------------------------------


def gateway_url(config: Config) -> str:
    """Where this machine reaches the server the config describes."""
    host = config.server.host
    if host in ("", "0.0.0.0", "::"):  # every address: loopback is one of them
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host.strip('[]')}]"
    return f"http://{host}:{config.server.port}"


def _client() -> httpx.Client:
    import httpx

    # Loopback: no proxy from the environment applies.
    return httpx.Client(timeout=10, trust_env=False, headers={"User-Agent": USER_AGENT})


def is_up(url: str) -> bool:
    """Whether a specgate answers at `url`. Reaching it may take 3 s (a
    host on the LAN that is off), its answer 15 s: a shared box busy with
    other requests answers late, and is not "not running"."""
    import httpx

    try:
        with _client() as c:
            r = c.get(f"{url}/health", timeout=httpx.Timeout(15, connect=3))
        return r.status_code == 200 and r.json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):
        return False


def start_gateway(config_path: str | None, url: str, say: Callable[[str], None]) -> int:
    """`specgate serve` in the background, ready; returns its pid."""
    import httpx

    from specgate.engines.home import launch_dir

    log_path = launch_dir() / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "specgate", "serve"]
    if config_path:
        args += ["--config", str(Path(config_path).expanduser().resolve())]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    say(f"no specgate at {url}: started `specgate serve` (pid {proc.pid}, log {log_path}); "
        f"it keeps running after the agent exits (stop it: kill {proc.pid})")  # fmt: skip
    deadline = time.monotonic() + READY_TIMEOUT_S
    with _client() as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise LaunchError(f"`specgate serve` exited ({proc.returncode}):\n{tail}")
            try:
                if c.get(f"{url}/ready", timeout=3).status_code == 200:
                    return proc.pid
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise LaunchError(f"`specgate serve` (pid {proc.pid}) not ready after {READY_TIMEOUT_S:g} s; "
                      f"see {log_path}")  # fmt: skip


def _models(url: str, key: str | None) -> tuple[int, list[dict]]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with _client() as c:
            r = c.get(f"{url}/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise LaunchError(f"cannot reach specgate at {url}: {e}") from None
    return r.status_code, (r.json().get("data", []) if r.status_code == 200 else [])


# -- the key ----------------------------------------------------------------------------


def key_name(agent: str) -> str:
    return f"launch-{agent}"


def _stored_key_path(agent: str) -> Path:
    from specgate.engines.home import launch_dir

    return launch_dir() / "keys" / agent


def stored_key(agent: str, keys_path: Path) -> str | None:
    """The key launch made for this agent, while the keys file still has it."""
    from specgate.gateway.access.keys import read_keys, split_key

    try:
        key = _stored_key_path(agent).read_text().strip()
    except OSError:
        return None
    parts = split_key(key)
    if parts is None:
        return None
    record = next((r for r in read_keys(keys_path) if r.key_id == parts[0]), None)
    ours = record is not None and record.name == key_name(agent) and record.matches(parts[1])
    return key if ours else None


def make_key(agent: str, keys_path: Path, say: Callable[[str], None]) -> str:
    """A new key named for the agent (replacing an older one of that name),
    kept where stored_key finds it."""
    from specgate.gateway.access.keys import add_key, revoke_key

    name = key_name(agent)
    if revoke_key(keys_path, name):
        say(f"replaced key '{name}' in {keys_path} (launch no longer had it)")
    key = add_key(keys_path, name)
    path = _stored_key_path(agent)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    say(f"added key '{name}' to {keys_path} (kept in {path} for the next launch)")
    return key


# -- one launch -------------------------------------------------------------------------


@dataclass
class Plan:
    agent: Agent
    target: Target
    config: AgentConfig
    notes: list[str]  # what a person wiring it by hand should know


def plan(agent: Agent, config: Config, config_path: str | None, *, url: str | None = None,
         model: str | None = None, key: str | None = None, dry: bool = False,
         say: Callable[[str], None] = lambda _: None) -> Plan:  # fmt: skip
    """Find (or, unless `dry`, start) the gateway and the key, and read the
    model; `dry` writes and starts nothing, and a server named by `url` is
    never started (it may be another machine's)."""
    named = url is not None
    url = (url or gateway_url(config)).rstrip("/")
    notes = []
    up = is_up(url)
    if not up and (dry or named):
        raise LaunchError(f"no specgate answers at {url}: start one (`specgate serve`), or run "
                          f"`specgate launch {agent.name}` without --url, which starts one")  # fmt: skip
    keys_path = config.auth.keys_path
    if key is None:
        from specgate.gateway.access.keys import read_keys

        needs_key = _models(url, None)[0] == 401 if up else bool(read_keys(keys_path))
        if not needs_key:
            key = OPEN_SERVER_KEY
            notes.append("the server has no API keys (open on loopback): the key is a placeholder")
        elif (key := stored_key(agent.name, keys_path)) is None:
            if dry:
                key = "YOUR_SPECGATE_KEY"
                notes.append(f"the server needs an API key: `specgate keys add NAME` makes one "
                             f"(`specgate launch {agent.name}` makes and keeps its own)")  # fmt: skip
            else:
                key = make_key(agent.name, keys_path, say)
    if not up:
        start_gateway(config_path, url, say)
    status, models = _models(url, key)
    if status == 401 and not dry:
        raise LaunchError(
            f"specgate at {url} does not take the key yet: a running server reads new keys on a "
            f"reload (`specgate reload --key ADMIN_KEY`, or SIGHUP) or restart; then launch again"
        )
    if status != 200:
        raise LaunchError(f"specgate at {url} answered {status} to /v1/models")
    if not models:
        raise LaunchError(f"specgate at {url} serves no model")
    entry = next((m for m in models if m["id"] == model), None) if model else models[0]
    if entry is None:
        raise LaunchError(f"model '{model}' is not served at {url} "
                          f"(it serves {', '.join(m['id'] for m in models)})")  # fmt: skip
    context = entry.get("context_length")
    if not context:
        notes.append(f"model '{entry['id']}' is not loaded, so its context is not known: the "
                     "agent guesses its own; launch again once it has served a request")  # fmt: skip
    target = Target(url, key, entry["id"], context)
    return Plan(agent, target, agent.configure(target), notes)


def render(p: Plan) -> str:
    """The plan as shell lines to paste: files, variables, then the command."""
    t, c = p.target, p.config
    window = (f"context {t.context} tokens, replies up to {t.reply_cap}" if t.context
              else "context unknown")  # fmt: skip
    lines = [f"# {p.agent.title}, as `specgate launch {p.agent.name}` runs it "
             f"(specgate's tests run {p.agent.package}@{p.agent.tested})",
             f"# specgate at {t.base_url}, model {t.model}: {window}"]  # fmt: skip
    lines += [f"# {note}" for note in p.notes]
    for path, text in c.files.items():
        lines.append(f"mkdir -p {shlex.quote(str(path.parent))}")
        lines.append(f"cat > {shlex.quote(str(path))} <<'SPECGATE_EOF'")
        lines += text.rstrip("\n").split("\n")
        lines.append("SPECGATE_EOF")
    lines += [f"unset {name}" for name in c.unset]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in c.env.items()]
    lines.append(shlex.join([p.agent.command, *c.args]))
    return "\n".join(lines) + "\n"


def run(p: Plan, agent_args: list[str], say: Callable[[str], None]) -> None:
    """Write the agent's files and become the agent (returns only on error)."""
    exe = shutil.which(p.agent.command)
    if exe is None:
        raise LaunchError(f"{p.agent.title} is not installed ({p.agent.command} is not on PATH): "
                          f"npm install -g {p.agent.package}   (specgate's tests run "
                          f"{p.agent.tested})")  # fmt: skip
    for path, text in p.config.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in p.config.unset} | p.config.env
    for note in p.notes:
        say(note)
    say(f"{p.agent.name} -> {p.target.base_url}, model {p.target.model}"
        + (f" (context {p.target.context} tokens)" if p.target.context else ""))  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, [exe, *p.config.args, *agent_args], env)


def run_cli(args) -> int:
    from specgate.gateway.access.keys import KeyFileError
    from specgate.gateway.config import ConfigError, default_config, load_config

    def say(line: str) -> None:
        print(f"specgate launch: {line}", file=sys.stderr)

    try:
        config = load_config(args.config) if args.config else default_config()
        p = plan(AGENTS[args.agent], config, args.config, url=args.url, model=args.model,
                 key=args.key, dry=args.print_config, say=say)  # fmt: skip
        if args.print_config:
            print(render(p), end="")
            return 0
        run(p, args.agent_args, say)
    except (LaunchError, ConfigError, KeyFileError, OSError) as e:
        say(str(e))
        return 2
    return 1  # (execve returned)
