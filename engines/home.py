"""SPECGATE_HOME: where specgate keeps everything it writes."""

from __future__ import annotations

import os
from pathlib import Path


def specgate_home() -> Path:
    """Where specgate keeps everything it writes ($SPECGATE_HOME, ~/.specgate)."""
    return Path(os.environ.get("SPECGATE_HOME") or Path.home() / ".specgate").expanduser()
