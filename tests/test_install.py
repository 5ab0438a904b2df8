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

from engines.home import specgate_home
from engines.llamacpp import install


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
