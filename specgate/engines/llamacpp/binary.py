"""Finding the `llama-server` binary specgate runs for the llamacpp engine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from specgate.engines.home import llama_cpp_dir

# The llama.cpp release vendored in llama-cpp-python 0.3.36 (its CHANGELOG names
# ggml-org/llama.cpp@0c1e57098, which is tag b11312; see
# shared/reference/llamacpp-route.md section 1). Builds live under a directory
# named after it, so a new pin never reuses an old binary.
LLAMA_CPP_TAG = "b11312"

INSTALL_HINT = "run `specgate install-llama-server` to build it (about 5-10 minutes)"


class LlamaServerMissing(FileNotFoundError):
    """No usable llama-server was found; the message says what to run."""


def installed_llama_server_path(home: Path | None = None) -> Path:
    """Where `specgate install-llama-server` puts the binary it builds."""
    return llama_cpp_dir(home) / LLAMA_CPP_TAG / "bin" / "llama-server"


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server(configured: str | None = None) -> Path:
    """The llama-server to run: the configured path, else PATH, else specgate's own build.

    A configured path is an explicit choice, so a bad one is an error rather
    than a silent fall-through to some other binary.
    """
    if configured:
        path = Path(configured).expanduser()
        if not path.exists():
            raise LlamaServerMissing(f"the configured llama-server {path} does not exist")
        if not _is_executable_file(path):
            raise LlamaServerMissing(
                f"the configured llama-server {path} is not an executable file"
            )
        return path
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    built = installed_llama_server_path()
    if _is_executable_file(built):
        return built
    raise LlamaServerMissing(
        f"llama-server not found: not on PATH and not built at {built}; {INSTALL_HINT}, "
        f"or set the path to one in the config"
    )


def llama_server_version(path: str | Path, timeout: float = 30.0) -> str:
    """The version line `llama-server --version` prints (it writes it to stderr)."""
    try:
        done = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {path} --version: {e}") from e
    lines = (done.stdout + "\n" + done.stderr).splitlines()
    version = next((line.strip() for line in lines if line.strip().startswith("version:")), None)
    if done.returncode != 0 or version is None:
        tail = "\n".join(lines[-5:]).strip()
        raise RuntimeError(f"{path} --version failed (exit {done.returncode}): {tail}")
    return version
