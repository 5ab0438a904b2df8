"""A real `specgate serve` for a benchmark: a free loopback port, a config
written from the given models, ready before it is handed out, and stopped
(the whole process group, llama-servers included) however the bench ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def serving(models: list[dict], workdir: Path, home: Path | None = None,
            timeout: float = 300, extra: dict | None = None, ranks: int = 1,
            ) -> Iterator[tuple[str, subprocess.Popen]]:  # fmt: skip
    """(base url, process) of a ready gateway serving `models`; raises
    GatewayFailed, with the end of the gateway's log, if it exits or does
    not become ready (the group is stopped either way). `home` is its
    SPECGATE_HOME (default: the user's, where llama-server builds live);
    `extra`: more top-level config sections (e.g. prefix_cache); `ranks` > 1:
    under `mlx.launch -n ranks --backend ring` on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {"server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
              "models": models, **(extra or {})}  # fmt: skip
    (workdir / "specgate.yaml").write_text(yaml.safe_dump(config))
    log = workdir / "gateway.log"
    env = os.environ | ({"SPECGATE_HOME": str(home)} if home else {})
    command = [sys.executable, "-m", "specgate", "serve", "--config", str(workdir / "specgate.yaml")]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ring = s.getsockname()[1]
        command = [str(Path(sys.executable).with_name("mlx.launch")), "-n", str(ranks),
                   "--backend", "ring", "--starting-port", str(ring), "--", *command]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log, timeout)
        yield url, proc
    finally:
        _stop(proc)


class GatewayFailed(RuntimeError):
    """The gateway exited before it was ready, a model failed to load, or it
    was not ready in time; the message ends with the gateway's log tail."""


def _log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log written)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the group (SIGKILL after 30 s), then until it is empty. A
    group already gone (a gateway that failed to start has exited) is not
    an error: the failure that ended the bench must stay the one reported."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    _wait_gone(proc.pid)


def _wait_gone(group: int, timeout: float = 60) -> None:
    """Until the process group is empty (mlx.launch's ranks drain after it exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GatewayFailed(f"gateway exited with {proc.returncode}; its log ends:\n{_log_tail(log)}")
        try:
            r = httpx.get(url + "/ready", timeout=2)
            if r.status_code == 200:
                return
            if "failed" in r.json().get("models", {}).values():
                raise GatewayFailed(f"a model failed to load: {r.json()['errors']}; the gateway's "
                                    f"log ends:\n{_log_tail(log)}")  # fmt: skip
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise GatewayFailed(f"gateway not ready in {timeout:.0f} s; its log ends:\n{_log_tail(log)}")
