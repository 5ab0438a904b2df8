"""specgate as a service (`specgate service install|uninstall|status`):
per user (the default) a launchd agent on macOS or a systemd user unit on
Linux; with --system a LaunchDaemon or a system unit that runs as the
invoking user (SUDO_USER). Both restart it when it exits, and it logs to
$SPECGATE_HOME/logs/specgate.log, rotated by specgate itself (launchd
rotates nothing; journald would, but one place for logs on both systems is
simpler to tell a team about).

An install checks first what would make it fail (root for --system, the
service manager, a user bus or a GUI login), so that a failure is one line
with the fix; whatever fails after that takes back all this run made
(`Made`): the service file, a starter config, the directories.

deploy/launchd/ and deploy/systemd/ hold the same files made for a
checkout in /opt/specgate, for reading and for hand installs; a test keeps
them equal to what this module writes.
"""

from __future__ import annotations

import os
import plistlib
import pwd
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specgate.engines.llamacpp.binary import installed_llama_server_path

LABEL = "dev.specgate.gateway"  # launchd label
UNIT = "specgate.service"  # systemd unit
# Where --system writes (tests point these into a temporary directory).
SYSTEM_DIRS = {"darwin": Path("/Library/LaunchDaemons"), "linux": Path("/etc/systemd/system")}
PROBE_TIMEOUT_S = 5  # a question to the service manager (is there a bus, is it running)
START_TIMEOUT_S = 90  # a command that loads or starts the service


class ServiceError(Exception):
    """What stops an install, in one line that says the fix."""


@dataclass(frozen=True)
class ServiceSpec:
    program: list[str]  # the command that runs `specgate`, e.g. [".../.venv/bin/specgate"]
    config: Path  # the YAML it serves
    home: Path  # SPECGATE_HOME
    workdir: Path  # relative model paths in the config resolve from here
    user: str | None = None  # the account a system service runs as; None: a per-user service
    group: str | None = None
    user_home: Path | None = None  # that account's home: HOME for a LaunchDaemon

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "specgate.log"

    @property
    def argv(self) -> list[str]:
        return [*self.program, "serve", "--config", str(self.config), "--log-file", str(self.log_file)]

    @property
    def search_path(self) -> str:
        """PATH for the service: launchd gives a job only /usr/bin:/bin:
        /usr/sbin:/sbin, so Homebrew's llama-server went unfound. This
        installation's bin first, then Homebrew's and /usr/local's ahead of
        the llama-server `specgate install-llama-server` builds: the order in
        which a shell with Homebrew on PATH finds one (engines/llamacpp/binary.py
        looks on PATH before the managed build)."""
        dirs = [str(Path(self.program[0]).parent), "/opt/homebrew/bin", "/usr/local/bin",
                str(installed_llama_server_path(self.home).parent), "/usr/bin", "/bin", "/usr/sbin", "/sbin"]  # fmt: skip
        return ":".join(dict.fromkeys(dirs))


def launchd_plist(spec: ServiceSpec) -> bytes:
    """A LaunchAgent (started at login) or, with a user, a LaunchDaemon
    (started at boot, run as that user); restarted whenever it exits (a
    crash or a kill; `launchctl bootout` stops it for good)."""
    env = {"PATH": spec.search_path, "SPECGATE_HOME": str(spec.home)}
    if spec.user and spec.user_home:
        # Said, not left to launchd: the Hugging Face cache and ~ in the
        # config resolve from it, and a daemon is started by root's launchd.
        env["HOME"] = str(spec.user_home)
    plist = {"Label": LABEL, "ProgramArguments": spec.argv, "WorkingDirectory": str(spec.workdir)}
    if spec.user:
        plist |= {"UserName": spec.user, "GroupName": spec.group or spec.user}
    return plistlib.dumps(plist | {
        "EnvironmentVariables": env,
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": 10,  # seconds between restarts
        "ProcessType": "Interactive",  # not throttled as a background job: it serves people
        # What is printed before logging starts (a bad config, a traceback).
        "StandardOutPath": str(spec.home / "logs" / "launchd.out.log"),
        "StandardErrorPath": str(spec.home / "logs" / "launchd.err.log"),
    }, sort_keys=False)  # fmt: skip


def _unit_escape(value: str) -> str:
    return value.replace("%", "%%")  # systemd expands %-specifiers in these settings


def systemd_unit(spec: ServiceSpec) -> str:
    """A user unit, or with a user a system unit that runs as that user."""
    env = [f"PATH={spec.search_path}", f"SPECGATE_HOME={spec.home}"]
    return "\n".join([
        "[Unit]",
        "Description=specgate: an OpenAI/Anthropic-compatible gateway over speculative decoding",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=exec",
        *([f"User={spec.user}", f"Group={spec.group or spec.user}"] if spec.user else []),
        f"ExecStart={_unit_escape(shlex.join(spec.argv)).replace('$', '$$')}",
        f"WorkingDirectory={_unit_escape(str(spec.workdir))}",
        *(f"Environment={_unit_escape(shlex.quote(e))}" for e in env),
        "ExecReload=/bin/kill -HUP $MAINPID",  # re-reads the config and the keys
        "Restart=always",
        "RestartSec=5",
        # SIGTERM drains: requests get server.shutdown_grace_s to finish.
        "TimeoutStopSec=60",
        "KillMode=mixed",  # SIGTERM to specgate, SIGKILL to whatever is left after
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if spec.user else 'default.target'}",
        "",
    ])  # fmt: skip


def service_path(system: str, scope: str = "user") -> Path:
    if scope == "system":
        return SYSTEM_DIRS[system] / (f"{LABEL}.plist" if system == "darwin" else UNIT)
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


def service_account(scope: str) -> pwd.struct_passwd:
    """Who the service runs as: the user who ran `sudo specgate ...` for a
    system service, else whoever runs this."""
    sudo_user = os.environ.get("SUDO_USER") if scope == "system" and os.geteuid() == 0 else None
    return pwd.getpwnam(sudo_user) if sudo_user else pwd.getpwuid(os.geteuid())


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """The command's result; None when it is missing or did not answer in time."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _one_line(done: subprocess.CompletedProcess | None) -> str:
    if done is None:
        return "no answer"
    return " ".join((done.stderr or done.stdout).split()) or f"exit status {done.returncode}"


def _systemctl(scope: str) -> list[str]:
    return ["systemctl", "--user"] if scope == "user" else ["systemctl"]


def _launchd_domain(scope: str) -> str:
    return f"gui/{os.getuid()}" if scope == "user" else "system"


def no_manager(system: str, scope: str) -> str | None:
    """Why this service manager cannot be reached from here (a reason
    without the fix), or None when it can."""
    tool = "launchctl" if system == "darwin" else "systemctl"
    if shutil.which(tool) is None:
        return f"{tool} not found"
    if system == "linux":
        done = _run([*_systemctl(scope), "show-environment"], PROBE_TIMEOUT_S)
        if done is None or done.returncode != 0:
            if scope == "user":
                return f"no systemd user session here (no user bus: {_one_line(done)})"
            return f"systemd does not run here ({_one_line(done)})"
    if system == "darwin" and scope == "user":
        done = _run(["launchctl", "print", _launchd_domain(scope)], PROBE_TIMEOUT_S)
        if done is None or done.returncode != 0:
            return f"no GUI login session for {pwd.getpwuid(os.getuid()).pw_name} (an ssh login?)"
    return None


def check_root(system: str, scope: str, again: list[str], euid: int | None = None) -> None:
    """A system service's file is root's to write: ServiceError with the
    sudo command (`again`: this command's arguments) when not root."""
    euid = os.geteuid() if euid is None else euid
    if scope == "system" and euid != 0:
        raise ServiceError(f"specgate service: --system changes {service_path(system, scope)}, which needs "
                           f"root: sudo {shlex.join([*this_specgate(), *again])}")  # fmt: skip


def preflight(system: str, scope: str, start: bool, install_args: list[str], euid: int | None = None) -> None:
    """Raise ServiceError, with the fix, for what would stop the install,
    before anything is written. `install_args`: this install's options
    (e.g. --config), for the command a fix suggests; `euid` for tests."""
    euid = os.geteuid() if euid is None else euid
    again = ["service", "install", "--system", *install_args]
    check_root(system, scope, again, euid)
    rerun = shlex.join([*this_specgate(), *again])
    if not start:
        return  # the file only: nothing asks the service manager
    reason = no_manager(system, scope)
    if reason is None:
        return
    user = pwd.getpwuid(euid).pw_name
    if reason.endswith("not found") or scope == "system":
        raise ServiceError(f"specgate service: {reason}, so nothing here can run a service; run "
                           f"`specgate serve` under your own supervisor, or install with --no-start to get the file")  # fmt: skip
    if system == "linux":
        raise ServiceError(f"specgate service: no systemd user session here (no user bus); install a system "
                           f"unit instead: sudo {rerun}, or enable lingering (sudo loginctl enable-linger "
                           f"{user}) and log in again")  # fmt: skip
    raise ServiceError(f"specgate service: {reason}; log in to this Mac's desktop once, or install a "
                       f"LaunchDaemon instead: sudo {rerun}")  # fmt: skip


class Made:
    """What one install made, so that a failure takes all of it back."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []  # created, outermost first
        self.files: list[tuple[Path, bytes | None]] = []  # and what was there before
        self.undo_first: list[list[str]] = []  # before the files go (systemctl disable)
        self.undo_last: list[list[str]] = []  # after (daemon-reload)

    def mkdir(self, path: Path) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        self.dirs.extend(reversed(missing))

    def new_file(self, path: Path) -> None:
        """A file written elsewhere (the starter config) that was not there before."""
        self.files.append((path, None))

    def write(self, path: Path, data: bytes) -> None:
        self.mkdir(path.parent)
        self.files.append((path, path.read_bytes() if path.exists() else None))
        path.write_bytes(data)
        path.chmod(0o644)

    def chown(self, account: pwd.struct_passwd) -> None:
        """Hand what was made so far to the service's account (a system
        install runs as root and makes the user's home and logs)."""
        for path in [*self.dirs, *(p for p, _ in self.files)]:
            os.chown(path, account.pw_uid, account.pw_gid)

    def undo(self) -> None:
        for command in self.undo_first:
            _run(command, START_TIMEOUT_S)
        for path, before in reversed(self.files):
            if before is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(before)
        for top in reversed(self.dirs):  # only if empty: systemctl may leave an empty *.wants
            for d, _, _ in sorted(os.walk(top, topdown=False), reverse=True):
                if not any(Path(d).iterdir()):
                    Path(d).rmdir()
        for command in self.undo_last:
            _run(command, START_TIMEOUT_S)


def start_commands(system: str, scope: str, path: Path, replacing: bool) -> list[list[str]]:
    if system == "darwin":
        domain = _launchd_domain(scope)
        return [["launchctl", "bootout", domain, str(path)],  # an older one, if loaded
                ["launchctl", "bootstrap", domain, str(path)]]  # fmt: skip
    systemctl = _systemctl(scope)
    if replacing:  # `enable --now` would leave a running one on its old unit
        return [[*systemctl, "daemon-reload"], [*systemctl, "enable", UNIT], [*systemctl, "restart", UNIT]]
    return [[*systemctl, "daemon-reload"], [*systemctl, "enable", "--now", UNIT]]


def install(spec: ServiceSpec, system: str, scope: str, start: bool, made: Made) -> tuple[Path, list[list[str]]]:
    """Write the service file; returns it and the commands that start it
    (run here when `start`). On a failure the caller undoes `made`."""
    path = service_path(system, scope)
    made.mkdir(spec.log_file.parent)
    if scope == "system" and os.geteuid() == 0:
        made.chown(pwd.getpwnam(spec.user))
    replacing = path.exists()
    made.write(path, launchd_plist(spec) if system == "darwin" else systemd_unit(spec).encode())
    commands = start_commands(system, scope, path, replacing)
    if not start:
        return path, commands
    if system == "linux":
        if not replacing:
            made.undo_first.append([*_systemctl(scope), "disable", UNIT])
        made.undo_last.append([*_systemctl(scope), "daemon-reload"])
    if replacing:  # the old file is put back: run it again, as before this install
        made.undo_last.append(commands[-1] if system == "darwin" else [*_systemctl(scope), "restart", UNIT])
    for i, command in enumerate(commands):
        done = _run(command, START_TIMEOUT_S)
        if done is None or done.returncode != 0:
            if system == "darwin" and i == 0:
                continue  # bootout finds none loaded
            raise ServiceError(f"specgate service: `{shlex.join(command)}` failed ({_one_line(done)}); "
                               f"nothing installed")  # fmt: skip
    return path, commands


def lingering_off(user: str) -> bool:
    """Whether systemd stops this user's services at logout; False when it
    cannot be told."""
    done = _run(["loginctl", "show-user", user, "-p", "Linger"], PROBE_TIMEOUT_S)
    return done is not None and done.returncode == 0 and done.stdout.strip() == "Linger=no"


def installed_argv(path: Path, system: str) -> list[str]:
    """The command line an installed service file runs ([] if unreadable)."""
    try:
        if system == "darwin":
            return list(plistlib.loads(path.read_bytes())["ProgramArguments"])
        for line in path.read_text().splitlines():
            if line.startswith("ExecStart="):
                return shlex.split(line.removeprefix("ExecStart=").replace("$$", "$").replace("%%", "%"))
    except (OSError, ValueError, KeyError):
        pass
    return []


def option(argv: list[str], name: str) -> str | None:
    """The value of `name` in an installed command line (installed_argv)."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def uninstall(system: str, scope: str, stop: bool) -> tuple[Path, list[str]] | None:
    """Stop (when `stop`) and remove the service file; returns it and the
    command line it ran, or None if there was none."""
    path = service_path(system, scope)
    if not path.exists():
        return None
    argv = installed_argv(path, system)
    if stop:
        if system == "darwin":
            _run(["launchctl", "bootout", _launchd_domain(scope), str(path)], START_TIMEOUT_S)
        else:
            _run([*_systemctl(scope), "disable", "--now", UNIT], START_TIMEOUT_S)
    path.unlink()
    if system == "linux":  # `enable`'s link, which `disable` cannot remove without a bus
        wants = path.parent / f"{'default' if scope == 'user' else 'multi-user'}.target.wants" / UNIT
        if wants.is_symlink():
            wants.unlink()
        if stop:
            _run([*_systemctl(scope), "daemon-reload"], START_TIMEOUT_S)
    return path, argv


def state(system: str, scope: str) -> str:
    """The service manager's word on it: running, stopped, not loaded, ...;
    or why it cannot be asked."""
    reason = no_manager(system, scope)
    if reason:
        return f"unknown: {reason}"
    if system == "darwin":
        done = _run(["launchctl", "print", f"{_launchd_domain(scope)}/{LABEL}"], PROBE_TIMEOUT_S)
        if done is None or done.returncode != 0:
            return "not loaded"
        states = [line.split("=", 1)[1].strip() for line in done.stdout.splitlines()
                  if line.strip().startswith("state =")]  # fmt: skip
        return states[0] if states else "loaded"
    done = _run([*_systemctl(scope), "is-active", UNIT], PROBE_TIMEOUT_S)
    return (done.stdout.strip() if done else "") or f"unknown: {_one_line(done)}"


def example(system: str, scope: str = "user") -> ServiceSpec:
    """What deploy/launchd/ and deploy/systemd/ were made for: a checkout
    in /opt/specgate (`uv sync` there), user "you"."""
    user_home = Path("/Users/you" if system == "darwin" else "/home/you")
    user, group = ("you", "staff" if system == "darwin" else "you") if scope == "system" else (None, None)
    return ServiceSpec(["/opt/specgate/.venv/bin/specgate"], user_home / ".specgate/specgate.yaml",
                       user_home / ".specgate", Path("/opt/specgate"), user, group,
                       user_home if scope == "system" else None)  # fmt: skip
