"""The embedded demo model: served when the user names no model of their own.

A small Qwen3.5 hybrid with a trained MTP head, shipped inside the package
(`demo/`, 16 MB), so `specgate serve` answers at once on a fresh machine with
no download. `specgate demo-model` trains one like it (see demo_training.py);
the README records the command that produced the shipped one.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_ID = "specgate-demo"
PACKAGED_DEMO = Path(__file__).parent / "demo"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def specgate_home() -> Path:
    """Where specgate keeps everything it writes ($SPECGATE_HOME, ~/.specgate)."""
    return Path(os.environ.get("SPECGATE_HOME") or Path.home() / ".specgate").expanduser()


def default_model_path() -> Path:
    """The shipped demo model's directory."""
    missing = [name for name in _REQUIRED if not (PACKAGED_DEMO / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model shipped with specgate is incomplete ({', '.join(missing)} missing "
            f"in {PACKAGED_DEMO}); reinstall specgate, or train one with `specgate demo-model` "
            f"and name it in a config"
        )
    return PACKAGED_DEMO
