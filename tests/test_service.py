"""specgate as a service: the launchd agent and systemd unit it writes (the
shipped copies in deploy/ kept equal to them), `specgate service
install|uninstall` for the current user, and `serve --log-file`."""

from __future__ import annotations

import os
import plistlib
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

from specgate.gateway.operator import service
from specgate.gateway.operator.cli import main

DEPLOY = REPO / "deploy"


def test_the_shipped_files_are_what_specgate_writes():
    assert (DEPLOY / "launchd" / f"{service.LABEL}.plist").read_bytes() == service.launchd_plist(
        service.example("darwin"))
    assert (DEPLOY / "systemd" / service.UNIT).read_text() == service.systemd_unit(service.example("linux"))


def test_the_launchd_agent_restarts_specgate_and_logs_under_its_home():
    spec = service.example("darwin")
    plist = plistlib.loads(service.launchd_plist(spec))
    assert plist["Label"] == service.LABEL
    assert plist["ProgramArguments"] == [*spec.program, "serve", "--config", str(spec.config),
                                         "--log-file", str(spec.home / "logs" / "specgate.log")]  # fmt: skip
    assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True
    assert plist["EnvironmentVariables"] == {"SPECGATE_HOME": str(spec.home)}
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert Path(plist[key]).parent == spec.home / "logs"
    assert all(isinstance(a, str) for a in plist["ProgramArguments"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_the_systemd_unit_verifies(tmp_path):
    spec = service.ServiceSpec([sys.executable, "-m", "specgate"], tmp_path / "c.yaml",
                               tmp_path / "home", tmp_path)  # fmt: skip
    unit = tmp_path / service.UNIT
    unit.write_text(service.systemd_unit(spec))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stderr
    exec_start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    assert shlex.split(exec_start.removeprefix("ExecStart=")) == spec.argv
    # The check can fail: a misspelt setting is reported.
    unit.write_text(unit.read_text().replace("Restart=always", "Restart=alwayz"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert "alwayz" in done.stderr


@pytest.mark.skipif(sys.platform == "darwin", reason="would write a real LaunchAgent path")
def test_install_and_uninstall_for_the_current_user(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path / "sg"))
    unit = tmp_path / ".config" / "systemd" / "user" / service.UNIT

    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    assert main(["service", "install", "--no-start", "--config", str(bad)]) == 2
    assert "bad config, nothing installed" in capsys.readouterr().err and not unit.exists()

    assert main(["service", "install", "--no-start"]) == 0  # the starter config is written
    config = tmp_path / "sg" / "specgate.yaml"
    assert yaml.safe_load(config.read_text())["models"][0]["path"] == "builtin:demo"
    exec_start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert argv[-4:] == ["--config", str(config), "--log-file", str(tmp_path / "sg/logs/specgate.log")]
    assert "systemctl --user enable --now specgate.service" in capsys.readouterr().out

    assert main(["service", "uninstall", "--no-stop"]) == 0
    assert not unit.exists() and "removed" in capsys.readouterr().out
    assert main(["service", "uninstall", "--no-stop"]) == 0
    assert "no service installed" in capsys.readouterr().out


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
        httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    text = log_file.read_text()
    assert f"listening on http://127.0.0.1:{port}" in text and "model m ready" in text
    assert '"GET /health HTTP/1.1" 200' in text  # uvicorn's access log, in the same file
    assert "PyTorch" not in text, text
    assert out == b"", out  # nothing on stdout/stderr
