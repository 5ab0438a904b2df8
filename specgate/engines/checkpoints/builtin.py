"""The embedded demo model: served when the user names no model of their own.

A small Qwen3.5 hybrid with a trained MTP head, shipped inside the package
(`demo/`, 16 MB), so `specgate serve` answers at once on a fresh machine with
no download. `specgate demo-model` trains one like it (see demo_training.py);
the README records the command that produced the shipped one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from specgate.engines.checkpoints.locate import BUILTIN_PREFIX
from specgate.engines.home import models_dir

DEFAULT_MODEL_ID = "specgate-demo"
BUILTIN_DEMO = "builtin:demo"
# The demo model exported to GGUF (MTP head as nextn) on first use, for llama-server.
BUILTIN_DEMO_GGUF = "builtin:demo-gguf"
BUILTIN_DEMO_DFLASH = "builtin:demo-dflash"  # the demo's trained DFlash drafter
BUILTINS = (BUILTIN_DEMO, BUILTIN_DEMO_GGUF, BUILTIN_DEMO_DFLASH)
PACKAGED_DEMO = Path(__file__).parent / "demo"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


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


def demo_dflash_path() -> Path:
    """The shipped DFlash block drafter trained for the demo model
    (`demo_dflash/`; `specgate demo-drafter` trains one, see dflash_training.py)."""
    path = Path(__file__).parent / "demo_dflash"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the demo DFlash drafter shipped with specgate is incomplete ({path}); reinstall "
            f"specgate, or train one with `specgate demo-drafter`"
        )
    return path


# Writes a checkpoint directory out as one GGUF file (builders/gguf_export.py's
# export_gguf). Passed in by the caller: exporting is building, and nothing
# under engines/ imports builders/.
ExportGGUF = Callable[[Path, Path], None]


def demo_gguf_path(export: ExportGGUF | None = None) -> Path:
    """The demo model as GGUF (MTP head as nextn), exported with `export` on
    first use; without `export`, only if it was exported before.

    Cached under SPECGATE_HOME by the digest of the weights and the
    tokenizer's config (the chat template is written into the GGUF), so a
    new demo model or template gets a new file and an interrupted export
    never leaves a partial one.
    """
    import hashlib

    src = default_model_path()
    digest = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer_config.json"):
        digest.update((src / name).read_bytes())
    out = models_dir() / f"{DEFAULT_MODEL_ID}-{digest.hexdigest()[:16]}.gguf"
    if not out.is_file():
        if export is None:
            raise FileNotFoundError(f"{BUILTIN_DEMO_GGUF} is not exported yet ({out})")
        tmp = out.with_suffix(f".{os.getpid()}.partial")
        export(src, tmp)
        tmp.replace(out)
    return out


class UnknownBuiltin(ValueError):
    """A builtin: name that specgate does not ship."""


def builtin_path(name: str, export: ExportGGUF | None = None) -> Path:
    """The directory or file a builtin name stands for (the GGUF exported with
    `export` on first use); UnknownBuiltin for a name that is not one."""
    where = {BUILTIN_DEMO: default_model_path, BUILTIN_DEMO_GGUF: partial(demo_gguf_path, export),
             BUILTIN_DEMO_DFLASH: demo_dflash_path}.get(name)
    if where is None:
        raise UnknownBuiltin(f"{name}: no such builtin model (there are {', '.join(BUILTINS)})")
    return where()


def resolve_builtin(path: str, export: ExportGGUF | None = None) -> str:
    """`path` as given, or the local path of the builtin it names."""
    return str(builtin_path(path, export)) if path.startswith(BUILTIN_PREFIX) else path
