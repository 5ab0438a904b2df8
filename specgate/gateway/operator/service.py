"""specgate as a per-user service: a launchd agent on macOS, a systemd user
unit on Linux (`specgate service install|uninstall`). Both restart it when
it exits, and it logs to $SPECGATE_HOME/logs/specgate.log, rotated by
specgate itself (launchd rotates nothing; journald would, but one place for
logs on both systems is simpler to tell a team about).

deploy/launchd/ and deploy/systemd/ hold the same files made for a
checkout in /opt/specgate, for reading and for hand installs; a test keeps
them equal to what this module writes.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LABEL = "dev.specgate.gateway"  # launchd label
UNIT = "specgate.service"  # systemd user unit


@dataclass(frozen=True)
class ServiceSpec:
    program: list[str]  # the command that runs `specgate`, e.g. [".../.venv/bin/specgate"]
    config: Path  # the YAML it serves
    home: Path  # SPECGATE_HOME
    workdir: Path  # relative model paths in the config resolve from here

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "specgate.log"

    @property
    def argv(self) -> list[str]:
        return [*self.program, "serve", "--config", str(self.config), "--log-file", str(self.log_file)]


def launchd_plist(spec: ServiceSpec) -> bytes:
    """A LaunchAgent: started at login, restarted whenever it exits (a crash
    or a kill; `launchctl bootout` stops it for good)."""
    return plistlib.dumps({
        "Label": LABEL,
        "ProgramArguments": spec.argv,
        "WorkingDirectory": str(spec.workdir),
        "EnvironmentVariables": {"SPECGATE_HOME": str(spec.home)},
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": 10,  # seconds between restarts
        "ProcessType": "Interactive",  # not throttled as a background job: it serves people
        # What is printed before logging starts (a bad config, a traceback).
        "StandardOutPath": str(spec.home / "logs" / "launchd.out.log"),
        "StandardErrorPath": str(spec.home / "logs" / "launchd.err.log"),
    }, sort_keys=False)  # fmt: skip


def systemd_unit(spec: ServiceSpec) -> str:
    return "\n".join([
        "[Unit]",
        "Description=specgate: an OpenAI/Anthropic-compatible gateway over speculative decoding",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=exec",
        f"ExecStart={shlex.join(spec.argv)}",
        f"WorkingDirectory={spec.workdir}",
        f"Environment=SPECGATE_HOME={spec.home}",
        "ExecReload=/bin/kill -HUP $MAINPID",  # re-reads the config and the keys
        "Restart=always",
        "RestartSec=5",
        # SIGTERM drains: requests get server.shutdown_grace_s to finish.
        "TimeoutStopSec=60",
        "KillMode=mixed",  # SIGTERM to specgate, SIGKILL to whatever is left after
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])  # fmt: skip


def service_path(system: str) -> Path:
    if system == "darwin":
        return Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "systemd" / "user" / UNIT


def current_system() -> str:
    return "darwin" if sys.platform == "darwin" else "linux"


def this_specgate() -> list[str]:
    """The command that runs this installation's specgate."""
    script = Path(sys.executable).with_name("specgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specgate"]


def install(spec: ServiceSpec, system: str, start: bool) -> tuple[Path, list[list[str]]]:
    """Write the service file; returns it and the commands that start it
    (run here when `start`)."""
    path = service_path(system)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    if system == "darwin":
        path.write_bytes(launchd_plist(spec))
        domain = f"gui/{os.getuid()}"
        commands = [["launchctl", "bootout", domain, str(path)],  # an older one, if loaded
                    ["launchctl", "bootstrap", domain, str(path)]]  # fmt: skip
    else:
        path.write_text(systemd_unit(spec))
        commands = [["systemctl", "--user", "daemon-reload"],
                    ["systemctl", "--user", "enable", "--now", UNIT]]  # fmt: skip
    if start:
        for i, command in enumerate(commands):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0 and not (system == "darwin" and i == 0):  # bootout may find none
                raise OSError(f"{shlex.join(command)} failed: {done.stderr.strip() or done.returncode}")
    return path, commands


def uninstall(system: str, stop: bool) -> Path | None:
    """Stop (when `stop`) and remove the service file; None if there was none."""
    path = service_path(system)
    if not path.exists():
        return None
    if stop:
        if system == "darwin":
            command = ["launchctl", "bootout", f"gui/{os.getuid()}", str(path)]
        else:
            command = ["systemctl", "--user", "disable", "--now", UNIT]
        subprocess.run(command, capture_output=True)
    path.unlink()
    if stop and system == "linux":
        subprocess.run(["systemctl", "--user", "daemon-reload"], capture_output=True)
    return path


def example(system: str) -> ServiceSpec:
    """What deploy/launchd/ and deploy/systemd/ were made for: a checkout
    in /opt/specgate (`uv sync` there), user "you"."""
    user_home = Path("/Users/you" if system == "darwin" else "/home/you")
    return ServiceSpec(["/opt/specgate/.venv/bin/specgate"], user_home / ".specgate/specgate.yaml",
                       user_home / ".specgate", Path("/opt/specgate"))  # fmt: skip
