"""A private virtual environment for the peer project mlx-dspark (MIT).

mlx-dspark runs in its own venv, never in the project's: it needs mlx-vlm, whose
declared dependencies (datasets, opencv, mlx-audio, fastapi, ...) are of no use
here and would drag the project's lock around. Only `mlx_vlm.models.rope_utils`
is imported by mlx-dspark (model.py:16-18), so mlx-vlm goes in without its
dependencies, and every package is pinned to the exact version of a resolved,
tested install (`uv pip install --no-deps` of the whole list), so the env is
the same on every machine.

    from tests.peers.mlx_dspark_env import mlx_dspark_python
    python = mlx_dspark_python()   # <SPECGATE_HOME>/peers/mlx-dspark-0.20.3/venv/bin/python

Run tests/peers/mlx_dspark_greedy.py with that python.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from specgate.engines.home import peers_dir

MLX_DSPARK_VERSION = "0.20.3"
PYTHON_VERSION = "3.11"

# `uv pip freeze` of a working env (Linux x86_64, Python 3.11). mlx/mlx-lm are the
# project's own versions. mlx-vlm: import-only dependency (see the docstring).
PINNED = (
    f"mlx-dspark=={MLX_DSPARK_VERSION}",
    "mlx==0.32.4",
    "mlx-cpu==0.32.4; sys_platform == 'linux'",
    "mlx-metal==0.32.4; sys_platform == 'darwin'",
    "mlx-lm==0.32.2",
    "mlx-vlm==0.7.10",
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "click==8.5.1",
    "filelock==4.3.1",
    "fsspec==2026.9.0",
    "h11==0.16.0",
    "hf-xet==1.8.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface-hub==2.4.0",
    "idna==3.20",
    "jinja2==3.1.6",
    "markdown-it-py==4.3.0",
    "markupsafe==3.0.4",
    "mdurl==0.1.2",
    "numpy==2.4.6",
    "packaging==26.4",
    "pillow==13.0.0",
    "protobuf==7.36.2",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pygments==2.21.0",
    "pyyaml==6.0.4",
    "regex==2026.11.19",
    "requests==2.34.2",
    "rich==15.0.0",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "shellingham==1.5.4",
    "tokenizers==0.23.3",
    "tqdm==4.70.1",
    "transformers==5.24.0",
    "truststore==0.10.5",
    "typer==0.29.2",
    "typing-extensions==4.16.0",
    "typing-inspection==0.4.5",
    "urllib3==2.8.0",
)


def mlx_dspark_env_dir() -> Path:
    return peers_dir() / f"mlx-dspark-{MLX_DSPARK_VERSION}"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(
            f"installing mlx-dspark {MLX_DSPARK_VERSION} failed (exit {proc.returncode}) "
            f"running: {' '.join(cmd)}\nfull log: {log}\nlast lines:\n{tail}"
        )


def mlx_dspark_python() -> Path:
    """The python of a venv holding mlx-dspark, created on first call (a few seconds
    with a warm uv cache). The marker is written last, and holds the pin list, so an
    interrupted or outdated install is redone from scratch."""
    root = mlx_dspark_env_dir()
    venv, marker = root / "venv", root / "installed.txt"
    want = "\n".join(PINNED) + "\n"
    python = _venv_python(venv)
    if marker.is_file() and marker.read_text() == want and python.is_file():
        return python
    # `uv run` names itself in $UV (CI may have uv only as `python3 -m uv`).
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        raise RuntimeError("`uv` is not on PATH: it is needed to build the mlx-dspark venv")
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers: one installs, the rest wait
        if marker.is_file() and marker.read_text() == want and python.is_file():
            return python
        marker.unlink(missing_ok=True)
        shutil.rmtree(venv, ignore_errors=True)
        log = root / "install.log"
        log.write_text("")
        requirements = root / "requirements.txt"
        requirements.write_text(want)
        _run([uv, "venv", "--quiet", "--python", PYTHON_VERSION, str(venv)], log)
        _run(
            [uv, "pip", "install", "--python", str(python), "--no-deps",
             "-r", str(requirements)],
            log,
        )
        probe = "import mlx_dspark, mlx.core; print(mlx_dspark.__version__)"
        _run([str(python), "-c", probe], log)
        marker.write_text(want)
    return python


if __name__ == "__main__":
    print(mlx_dspark_python())
