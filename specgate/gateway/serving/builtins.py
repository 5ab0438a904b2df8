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
