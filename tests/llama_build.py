"""llama-server's build, run in the background while the rest of the suite runs.

The build (`specgate install-llama-server`, minutes on 2 cores the first time
in a SPECGATE_HOME) is what a user runs, so CI runs it from an empty home.
It starts at collection, in its own process group at a lower priority, and
tests that need llama-server are ordered last (conftest.py). A test that needs
it waits, before its own time limit starts, for the build's install lock
(specgate/engines/llamacpp/install.py) to be free; the `llama_server_binary` fixture
then finds the binary, or builds it itself and fails saying why.

One run can hold several processes (pytest-xdist's workers and their
controller): the first worker to collect a test that needs llama-server
starts the build, and the process that ends the run (the controller, or the
only process) stops a build still running, so none outlives the run.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specgate.engines.home import llama_cpp_dir, logs_dir
from specgate.engines.llamacpp.binary import installed_llama_server_path

REPO = Path(__file__).resolve().parents[1]
LOCK = ".install.lock"  # install_llama_server's own lock
RUN = "SPECGATE_TEST_RUN"  # set by the process that starts the run, inherited by its workers


def _pid_file(home: Path) -> Path:
    return llama_cpp_dir(home) / f".tests-build-{os.environ.get(RUN, 'none')}.pid"


def _held(home: Path) -> bool:
    """Whether an install holds the lock now."""
    path = llama_cpp_dir(home) / LOCK
    if not path.exists():
        return False
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def start(home: Path) -> None:
    """Start the build under `home` unless it is installed or being built;
    returns once the build holds the install lock (or has ended)."""
    root = llama_cpp_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".tests-build.lock", "a+") as starting:  # one starter per home at a time
        fcntl.flock(starting, fcntl.LOCK_EX)
        if installed_llama_server_path(home).is_file() or _held(home):
            return
        logs_dir(home).mkdir(parents=True, exist_ok=True)
        with open(logs_dir(home) / "tests-llama-server-build.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "specgate", "install-llama-server"], cwd=REPO,
                env=os.environ | {"SPECGATE_HOME": str(home)}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: os.nice(10))  # fmt: skip
        _pid_file(home).write_text(str(proc.pid))
        deadline = time.monotonic() + 60
        while not _held(home) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)


def wait(home: Path, timeout: float) -> None:
    """Until no install holds the lock (the background build ended), at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while _held(home) and time.monotonic() < deadline:
        time.sleep(1)


def stop(home: Path) -> None:
    """End this run's build if it still runs (the run ended before it was needed)."""
    pid_file = _pid_file(home)
    if not pid_file.is_file():
        return
    pid = int(pid_file.read_text())
    pid_file.unlink()
    if _held(home):
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
