"""Models where users already keep them: Ollama's store, LM Studio's models
folder, GGUF repos in the Hugging Face cache.

    resolve_source("ollama:llama3.2:3b")            # -> .../blobs/sha256-<hex>
    resolve_source("lmstudio:org/repo:Q4_K_M")      # -> .../org/repo/x-Q4_K_M.gguf
    resolve_source("org/name-GGUF:Q4_K_M")          # -> the cache snapshot's file
    resolve_source("org/name")                      # a GGUF-only repo's one file, else None

Each reads directories and small files only, and never downloads
(`specgate pull` does, gateway/operator/pull.py). Whether a file is a GGUF
is its first four bytes, not its name: Ollama's blobs have no suffix.
"""

from __future__ import annotations

import os
from pathlib import Path

from .gguf_pick import SourceError, is_gguf_file, pick_gguf
from .locate import REPO_ID, REPO_QUANT, STORE_PREFIXES, hub_offline

OLLAMA_PREFIX, LMSTUDIO_PREFIX = STORE_PREFIXES


def is_store_name(name: str) -> bool:
    """`ollama:...`, `lmstudio:...` or `org/name:QUANT`: never a local path."""
    return name.startswith(STORE_PREFIXES) or bool(REPO_QUANT.match(name))


def resolve_source(name: str) -> Path | None:
    """The local file or folder `name` stands for when it names a model
    store or a GGUF repo in the hub cache; None when it is none of those
    (a path, a builtin, a safetensors repo: the caller's as before).
    SourceError when it is one of those and nothing usable is there."""
    if name.startswith(OLLAMA_PREFIX):
        from .ollama_store import resolve_ollama

        return resolve_ollama(name[len(OLLAMA_PREFIX):])
    if name.startswith(LMSTUDIO_PREFIX):
        from .lmstudio_store import resolve_lmstudio

        return resolve_lmstudio(name[len(LMSTUDIO_PREFIX):])
    if m := REPO_QUANT.match(name):
        snapshot = hub_snapshot(m["repo"])
        if snapshot is None:
            offline = " (HF_HUB_OFFLINE is set)" if hub_offline() else ""
            raise SourceError(f"{m['repo']} is not in the local Hugging Face cache ({hub_cache_dir()})"
                              f"{offline}; download it with `specgate pull {name}`")
        return snapshot / pick_gguf(_ggufs_under(snapshot), m["quant"], f"{m['repo']} ({snapshot})",
                                    m["repo"])[0]
    if REPO_ID.match(name) and not Path(name).exists():
        snapshot = hub_snapshot(name)
        if snapshot is None or (snapshot / "config.json").exists():
            return None  # not here, or a safetensors repo: loading decides, as before
        ggufs = _ggufs_under(snapshot)
        if ggufs:
            return snapshot / pick_gguf(ggufs, None, f"{name} ({snapshot})", name)[0]
    return None


def names_gguf(name: str) -> bool:
    """Whether `name` is served as a GGUF: a `.gguf` name, or a file (as given or
    as a store resolves it) that starts with GGUF's magic."""
    if name.lower().endswith(".gguf"):
        return True
    try:
        found = resolve_source(name)
    except SourceError:
        return is_store_name(name) and not name.startswith(LMSTUDIO_PREFIX)  # ollama:, org/x:Q
    path = found if found is not None else Path(name).expanduser()
    return path.is_file() and is_gguf_file(path)


def _ggufs_under(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.suffix.lower() == ".gguf" and p.is_file()]


# ---------------------------------------------------------------- the hub cache


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read now (tests and users
    set HF_HOME after huggingface_hub may have read it at import)."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot of `repo_id` at `revision` (a branch or tag the
    cache has a ref for, or a commit), else its newest snapshot, else None."""
    repo = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / revision).read_text().strip()
    except OSError:
        ref = revision
    if (snapshots / ref).is_dir():
        return snapshots / ref
    try:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None
