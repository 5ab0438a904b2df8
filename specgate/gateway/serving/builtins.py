"""The builtin model names (`builtin:demo` and friends) as serving resolves
them: engines/checkpoints/builtin.py, with the demo's GGUF exported on first
use by builders/gguf_export.py. That export is the one piece of builders/
serving runs, so it is imported here, and only when a config names
`builtin:demo-gguf` and no export is cached yet."""

from __future__ import annotations

from pathlib import Path

from specgate.engines.checkpoints import builtin


def export_gguf(src: Path, out: Path) -> None:
    from specgate.builders.gguf_export import export_gguf as export

    export(src, out)


def builtin_path(name: str) -> Path:
    return builtin.builtin_path(name, export_gguf)


def resolve_builtin(path: str) -> str:
    return builtin.resolve_builtin(path, export_gguf)


def resolve_model_path(path: str) -> str:
    """A model's `path` as its engines load it: a builtin's local path, the
    file or folder a store name stands for now (ollama:, lmstudio:, a GGUF
    repo in the hub cache: engines/checkpoints/sources.py), else as given."""
    from specgate.engines.checkpoints.sources import resolve_source

    stored = None if path.startswith(builtin.BUILTIN_PREFIX) else resolve_source(path)
    return str(stored) if stored is not None else resolve_builtin(path)
