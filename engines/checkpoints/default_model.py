"""The embedded demo model: served when the user names no model of their own.

It is a tiny random Qwen3.5 hybrid with an MTP head, built locally on first
use, so `specgate` answers requests on a fresh machine with no download.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .tiny import build_qwen35_hybrid

DEFAULT_MODEL_ID = "specgate-demo"
# Bump the suffix when the builder's output changes, so old builds are not reused.
_DIR_NAME = "default-qwen35-tiny-v1"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def specgate_home() -> Path:
    """Where specgate keeps everything it writes ($SPECGATE_HOME, ~/.specgate)."""
    return Path(os.environ.get("SPECGATE_HOME") or Path.home() / ".specgate").expanduser()


def ensure_default_model(progress: Callable[[str], object] = print) -> Path:
    """The demo model's directory, building it on the first call."""
    dest = specgate_home() / "models" / _DIR_NAME
    if _complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    progress(
        f"specgate: building the embedded demo model (tiny random Qwen3.5 hybrid) "
        f"into {dest} (first run only)"
    )
    # Build beside the destination and rename, so a crash or a concurrent
    # start never leaves a half-written model where a loader would find it.
    tmp = Path(tempfile.mkdtemp(prefix=f".{_DIR_NAME}-", dir=dest.parent))
    try:
        build_qwen35_hybrid(tmp, seed=0)
        if _complete(dest):  # another process finished while we built
            return dest
        if dest.exists():  # incomplete, e.g. files removed by hand
            shutil.rmtree(dest)
        tmp.rename(dest)
    except OSError:
        # The rename lost a race: the winner's model is as good as ours.
        if not _complete(dest):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED)
