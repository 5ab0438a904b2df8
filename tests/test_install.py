"""`specgate install-llama-server` as a user runs it, from the project's own environment.

.ci/run gives the suite an empty SPECGATE_HOME, so the session's
`llama_server_binary` fixture (tests/conftest.py) is a real download and
build; these check the pieces a cached build once hid.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specgate.engines.home import specgate_home
from specgate.engines.llamacpp import install


def test_the_sources_are_downloaded_with_this_environments_own_pip():
    """Under `uv run` the venv's python has no pip unless specgate depends on
    it; a python3 found on PATH is that same pip-less interpreter."""
    cmd = install._pip_command()
    assert cmd[0] == sys.executable
    done = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip " in done.stdout


def test_the_cli_installs_into_specgate_home(llama_server_binary: Path):
    """The console script the README names, on the SPECGATE_HOME the build is in."""
    script = Path(sys.executable).with_name("specgate")
    env = os.environ | {"SPECGATE_HOME": str(specgate_home())}
    done = subprocess.run([str(script), "install-llama-server"], capture_output=True, text=True,
                          env=env, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(llama_server_binary)


def test_a_second_install_waits_for_the_first(llama_server_binary: Path):
    """Two installs into one SPECGATE_HOME (two shells, two test workers): the
    second waits for the first's lock, then finds its binary."""
    import fcntl
    import threading
    import time

    from specgate.engines.home import llama_cpp_dir

    said, result = [], []
    with open(llama_cpp_dir() / ".install.lock", "a+") as first:
        fcntl.flock(first, fcntl.LOCK_EX)  # the first install, still building
        first.truncate(0)
        first.write("pid 1 (the test)")
        first.flush()
        second = threading.Thread(
            target=lambda: result.append(install.install_llama_server(progress=said.append)))
        second.start()
        deadline = time.monotonic() + 60
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said == ["another install is under way (pid 1 (the test)); waiting for it"]
        assert second.is_alive() and not result
    second.join(timeout=120)
    assert result == [llama_server_binary]
    assert said[-1].startswith("llama-server is already installed")
