"""specgate as a service: the launchd plists and systemd units it writes
(the shipped copies in deploy/ kept equal to them), `specgate service
install|uninstall|status` per user and --system, and `serve --log-file`.

This container has systemctl and systemd-analyze but runs no systemd, so a
user install fails here for real (no user bus); the working way runs
against a fake systemctl (`_fake_systemd`)."""

from __future__ import annotations

import grp
import os
import plistlib
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import REPO, listening_port

from specgate.engines.llamacpp.binary import installed_llama_server_path
from specgate.gateway.operator import service
from specgate.gateway.operator.cli import main

DEPLOY = REPO / "deploy"
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def test_the_shipped_files_are_what_specgate_writes():
    for scope, plist, unit in (("user", "launchd", "systemd"),
                               ("system", "launchd/LaunchDaemons", "systemd/system")):  # fmt: skip
        assert (DEPLOY / plist / f"{service.LABEL}.plist").read_bytes() == service.launchd_plist(
            service.example("darwin", scope))
        assert (DEPLOY / unit / service.UNIT).read_text() == service.systemd_unit(service.example("linux", scope))


def _search_path_ok(search_path: str, spec: service.ServiceSpec) -> None:
    dirs = search_path.split(":")
    # Homebrew's llama-server (either prefix) is found, and ahead of the managed build, as in a shell.
    assert dirs.index("/opt/homebrew/bin") < dirs.index(str(installed_llama_server_path(spec.home).parent))
    assert "/usr/local/bin" in dirs and dirs[0] == str(Path(spec.program[0]).parent)
    assert search_path.endswith(SYSTEM_PATH)


@pytest.mark.parametrize("scope", ["user", "system"])
def test_the_launchd_plist_is_one_launchd_loads(scope):
    spec = service.example("darwin", scope)
    raw = service.launchd_plist(spec)
    assert raw.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE plist PUBLIC "-//Apple//DTD '
                          b'PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n<plist version="1.0">')  # fmt: skip
    plist = plistlib.loads(raw)
    assert plist["Label"] == service.LABEL
    assert plist["ProgramArguments"] == [*spec.program, "serve", "--config", str(spec.config),
                                         "--log-file", str(spec.home / "logs" / "specgate.log")]  # fmt: skip
    assert all(isinstance(a, str) for a in plist["ProgramArguments"])
    assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True
    assert plist["EnvironmentVariables"]["SPECGATE_HOME"] == str(spec.home)
    _search_path_ok(plist["EnvironmentVariables"]["PATH"], spec)
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert Path(plist[key]).parent == spec.home / "logs"
    if scope == "system":  # a LaunchDaemon runs as the user, not as root, in the user's HOME
        assert (plist["UserName"], plist["GroupName"]) == ("you", "staff")
        assert plist["EnvironmentVariables"]["HOME"] == "/Users/you"
    else:
        assert "UserName" not in plist and "HOME" not in plist["EnvironmentVariables"]


def _verify(unit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("scope", ["user", "system"])
def test_the_systemd_unit_verifies(tmp_path, scope):
    # A home with a space and a % (a systemd specifier) in its path; ExecStart
    # is this installation's specgate, a real file (verify checks it).
    me = pwd.getpwuid(os.getuid()).pw_name  # a real account (verify calls nobody unsafe)
    account = (me, grp.getgrgid(os.getgid()).gr_name) if scope == "system" else (None, None)
    spec = service.ServiceSpec(service.this_specgate(), tmp_path / "c.yaml", tmp_path / "a 50% home",
                               tmp_path, *account)  # fmt: skip
    unit = tmp_path / service.UNIT
    unit.write_text(service.systemd_unit(spec))
    done = _verify(unit)
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stderr
    assert service.installed_argv(unit, "linux") == spec.argv
    text = unit.read_text()
    assert (f"User={me}\n" in text) == (scope == "system")
    assert f"WantedBy={'multi-user' if scope == 'system' else 'default'}.target" in text
    env = dict(shlex.split(line.removeprefix("Environment=").replace("%%", "%"))[0].split("=", 1)
               for line in text.splitlines() if line.startswith("Environment="))  # fmt: skip
    assert env["SPECGATE_HOME"] == str(spec.home)
    _search_path_ok(env["PATH"], spec)
    # The check can fail: a misspelt setting is reported.
    unit.write_text(text.replace("Restart=always", "Restart=alwayz"))
    assert "alwayz" in _verify(unit).stderr


def _env(tmp_path: Path, path: str) -> dict[str, str]:
    """A user whose every directory is under tmp_path, with no session bus."""
    for d in ("home", "run"):
        (tmp_path / d).mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DBUS_SESSION_BUS_ADDRESS", "SUDO_USER")}
    return env | {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "home/.config"),
                  "XDG_RUNTIME_DIR": str(tmp_path / "run"), "SPECGATE_HOME": str(tmp_path / "home/sg"),
                  "PATH": path}  # fmt: skip


def _specgate(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*service.this_specgate(), "service", *args], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.skipif(sys.platform == "darwin", reason="systemd")
def test_without_a_user_bus_the_install_says_the_fix_and_writes_nothing(tmp_path):
    if shutil.which("systemctl") is None:
        pytest.skip("no systemctl: the no-bus case needs the real one")
    env = _env(tmp_path, os.environ["PATH"])
    before = _files(tmp_path)
    done = _specgate(env, "install")
    assert done.returncode == 1 and done.stdout == ""
    user = pwd.getpwuid(os.getuid()).pw_name
    assert done.stderr == (
        "specgate service: no systemd user session here (no user bus); install a system unit instead: "
        f"sudo {shlex.join(service.this_specgate())} service install --system, or enable lingering "
        f"(sudo loginctl enable-linger {user}) and log in again\n")
    assert _files(tmp_path) == before  # no unit, no starter config, no logs directory

    status = _specgate(env, "status")
    assert status.returncode == 3
    assert status.stdout.splitlines()[:2] == [
        f"not installed (no {tmp_path}/home/.config/systemd/user/{service.UNIT})",
        "state: unknown: no systemd user session here (no user bus: Failed to connect to bus: No such file "
        "or directory)"]  # fmt: skip

    # No systemctl at all: one line too (specgate itself runs by its absolute path).
    done = _specgate(_env(tmp_path, str(tmp_path / "run")), "install")
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("specgate service: systemctl not found, so nothing here can run a service")
    assert _files(tmp_path) == before


def _fake_systemd(tmp_path: Path, fail: str = "") -> Path:
    """A bin directory with a stand-in for systemctl talking to a systemd
    user manager, which this container cannot run: it records its calls
    (to calls.log) and fails (exit 1) on the verb `fail`; and a loginctl
    saying the user is not lingering."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path / "calls.log"}
for a in "$@"; do [ "$a" = "{fail or "-"}" ] && {{ echo "Job for specgate.service failed." >&2; exit 1; }}; done
[ "$2" = is-active ] && echo active
exit 0
""")
    (bin_dir / "loginctl").write_text("#!/bin/sh\necho Linger=no\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


@pytest.mark.skipif(sys.platform == "darwin", reason="systemd")
def test_a_user_install_starts_it_and_uninstall_takes_back_what_it_wrote(tmp_path):
    env = _env(tmp_path, f"{_fake_systemd(tmp_path)}:{os.environ['PATH']}")
    home, sg = tmp_path / "home", tmp_path / "home/sg"
    unit = home / ".config/systemd/user" / service.UNIT
    user = pwd.getpwuid(os.getuid()).pw_name

    done = _specgate(env, "install")
    assert done.returncode == 0, done.stderr
    assert _calls(tmp_path) == ["--user show-environment", "--user daemon-reload",
                                f"--user enable --now {service.UNIT}"]  # fmt: skip
    assert done.stdout.splitlines() == [
        f"wrote {sg}/specgate.yaml (the demo model; edit it, then `specgate reload`)",
        f"wrote {unit}; logs in {sg}/logs/specgate.log",
        "started; it starts again at login and after any exit",
        f"note: a user service stops when you log out; to keep it running: sudo loginctl enable-linger {user}"]
    assert _files(home) == [".config", ".config/systemd", ".config/systemd/user", f".config/systemd/user/{service.UNIT}",
                            "sg", "sg/logs", "sg/specgate.yaml"]  # fmt: skip
    assert yaml.safe_load((sg / "specgate.yaml").read_text())["models"][0]["path"] == "builtin:demo"
    assert service.installed_argv(unit, "linux")[-4:] == ["--config", f"{sg}/specgate.yaml",
                                                          "--log-file", f"{sg}/logs/specgate.log"]  # fmt: skip

    status = _specgate(env, "status")
    assert status.returncode == 0
    assert status.stdout.splitlines() == [
        f"installed: {unit}", "state: active",
        f"logs: {sg}/logs/specgate.log (what it prints before logging starts: journalctl --user -u {service.UNIT})"]
    _calls(tmp_path)

    # Again, over the running one: restarted on the new unit.
    assert _specgate(env, "install").returncode == 0
    assert _calls(tmp_path)[1:] == ["--user daemon-reload", f"--user enable {service.UNIT}",
                                    f"--user restart {service.UNIT}"]  # fmt: skip

    done = _specgate(env, "uninstall")
    assert done.returncode == 0
    assert done.stdout == f"removed {unit}; its config and logs ({sg}/specgate.yaml, {sg}/logs) are left in place\n"
    assert _calls(tmp_path) == [f"--user disable --now {service.UNIT}", "--user daemon-reload"]
    assert not unit.exists() and (sg / "specgate.yaml").exists()
    assert _specgate(env, "uninstall").stdout == f"no service installed ({unit})\n"


@pytest.mark.skipif(sys.platform == "darwin", reason="systemd")
def test_a_service_that_does_not_start_leaves_nothing_behind(tmp_path):
    env = _env(tmp_path, f"{_fake_systemd(tmp_path, fail='enable')}:{os.environ['PATH']}")
    before = _files(tmp_path / "home")
    done = _specgate(env, "install")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"specgate service: `systemctl --user enable --now {service.UNIT}` failed (Job for "
                           "specgate.service failed.); nothing installed\n")  # fmt: skip
    assert _files(tmp_path / "home") == before
    # Its enable link taken back, and systemd told the unit is gone.
    assert _calls(tmp_path)[-2:] == [f"--user disable {service.UNIT}", "--user daemon-reload"]

    # Over an installed one whose new unit does not start: the old file is back, and restarted.
    unit = tmp_path / "home/.config/systemd/user" / service.UNIT
    unit.parent.mkdir(parents=True)
    unit.write_text("the old unit\n")
    assert _specgate(env, "install").returncode == 1
    assert unit.read_text() == "the old unit\n" and _files(tmp_path / "home") == [
        ".config", ".config/systemd", ".config/systemd/user", f".config/systemd/user/{service.UNIT}"]
    assert _calls(tmp_path)[-3:] == [f"--user enable {service.UNIT}", "--user daemon-reload",
                                     f"--user restart {service.UNIT}"]  # fmt: skip


def test_a_system_install_needs_root_and_says_the_sudo_command(tmp_path, monkeypatch, capsys):
    # The tests may run as root (this container): the check is handed another uid.
    monkeypatch.setitem(service.SYSTEM_DIRS, "linux", tmp_path / "etc")
    monkeypatch.setitem(service.SYSTEM_DIRS, "darwin", tmp_path / "etc")
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path / "sg"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: pwd.getpwnam("nobody"))
    assert main(["service", "install", "--system", "--config", str(REPO / "README.md")]) == 1
    unit = service.service_path(service.current_system(), "system")
    assert capsys.readouterr().err == (
        f"specgate service: --system changes {unit}, which needs root: sudo "
        f"{shlex.join([*service.this_specgate(), 'service', 'install', '--system', '--config', str(REPO / 'README.md')])}\n")
    assert main(["service", "uninstall", "--system"]) == 1
    assert "which needs root: sudo" in capsys.readouterr().err
    assert _files(tmp_path) == []


@pytest.mark.skipif(sys.platform == "darwin" or os.geteuid() != 0, reason="a systemd system unit, as root")
def test_a_system_install_runs_as_the_sudo_user(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(service.SYSTEM_DIRS, "linux", tmp_path / "etc")
    monkeypatch.setenv("PATH", f"{_fake_systemd(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("SUDO_USER", "nobody")
    sg = tmp_path / "sg"
    monkeypatch.setenv("SPECGATE_HOME", str(sg))
    assert main(["service", "install", "--system"]) == 0, capsys.readouterr().err
    assert _calls(tmp_path) == ["show-environment", "daemon-reload", f"enable --now {service.UNIT}"]
    unit = tmp_path / "etc" / service.UNIT
    assert "User=nobody\nGroup=nogroup\n" in unit.read_text() and unit.stat().st_uid == 0
    for made in (sg, sg / "specgate.yaml", sg / "logs"):  # the user's, to write its logs to
        assert made.stat().st_uid == pwd.getpwnam("nobody").pw_uid
    assert "starts again at boot" in capsys.readouterr().out
    assert main(["service", "uninstall", "--system"]) == 0
    assert _calls(tmp_path) == [f"disable --now {service.UNIT}", "daemon-reload"] and not unit.exists()


@pytest.mark.skipif(sys.platform == "darwin", reason="would write a real LaunchAgent path")
def test_install_no_start_writes_the_file_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path / "sg"))
    unit = tmp_path / ".config" / "systemd" / "user" / service.UNIT

    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    assert main(["service", "install", "--no-start", "--config", str(bad)]) == 2
    assert "bad config, nothing installed" in capsys.readouterr().err
    assert _files(tmp_path) == ["bad.yaml"]

    assert main(["service", "install", "--no-start"]) == 0  # no service manager asked: no bus needed
    assert (tmp_path / "sg" / "specgate.yaml").exists() and unit.exists()
    assert capsys.readouterr().out.endswith(f"start it with:\n  systemctl --user daemon-reload\n"
                                            f"  systemctl --user enable --now {service.UNIT}\n")  # fmt: skip
    assert main(["service", "uninstall", "--no-stop"]) == 0
    assert not unit.exists() and "removed" in capsys.readouterr().out


def test_preflight_on_a_mac_without_a_gui_login(tmp_path, monkeypatch):
    # A stand-in launchctl that finds no gui/<uid> domain, as over ssh.
    (tmp_path / "launchctl").write_text("#!/bin/sh\nexit 113\n")
    (tmp_path / "launchctl").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(service.ServiceError) as e:
        service.preflight("darwin", "user", True, [], euid=os.geteuid())
    assert "no GUI login session" in str(e.value) and "install --system" in str(e.value)
    assert "\n" not in str(e.value)


def test_serve_logs_to_the_file_it_is_given(tiny_model, tmp_path):
    """Its own log, and nothing else: not on its output, and no third
    party's import-time banner (transformers' "PyTorch was not found", here
    where PyTorch is not installed) in the file either."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"models": [{"id": "m", "path": str(tiny_model)}]}))
    log_file = tmp_path / "logs" / "specgate.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specgate", "serve", "--config", str(config), "--port", "0",
         "--log-file", str(log_file)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        # CI set: transformers then also hands its warnings to the root
        # logger, i.e. to this file, as on a CI machine.
        env={**os.environ, "SPECGATE_HOME": str(tmp_path / "home"), "CI": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        port = None
        while time.monotonic() < deadline and proc.poll() is None:
            # The port it bound (0: its own pick) is in the file's first lines.
            if port is None and log_file.exists():
                port = listening_port(log_file.read_bytes())
            try:
                if port and httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert port is not None, "no `listening on` line in the log file"
        httpx.get(f"http://127.0.0.1:{port}/v1/models")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    text = log_file.read_text()
    assert f"listening on http://127.0.0.1:{port}" in text and "model m ready" in text
    # The access log, in the same file (gateway/access/access_log.py).
    assert re.search(r"INFO specgate\.access: .* method=GET path=/v1/models .* status=200 ", text), text
    assert "PyTorch" not in text, text
    assert out == b"", out  # nothing on stdout/stderr
