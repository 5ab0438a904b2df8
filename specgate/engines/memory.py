"""How much memory this machine has, and what a loaded model takes."""

from __future__ import annotations

import os
import subprocess
import sys


def physical_memory() -> int:
    """Bytes of RAM (on Apple silicon: the unified memory the GPU shares)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not in this libc's sysconf
        return 8 << 30


def process_rss(pid: int) -> int | None:
    """Resident bytes of process `pid` (a llama-server), None if it is gone."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None
    try:  # macOS and other BSDs: no /proc
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                             text=True, timeout=5)  # fmt: skip
        return int(out.stdout.strip()) * 1024 if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def parameter_bytes(module) -> int:
    """Bytes of an MLX module's parameters (its weights as loaded)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))
