"""Where a model that a config or a command names lives.

A name is a builtin ("builtin:demo", engines/checkpoints/builtin.py), a
local path, a Hugging Face repo id ("org/name"), or a model another tool
keeps ("ollama:NAME[:TAG]", "lmstudio:PUBLISHER/REPO", a GGUF repo's
"org/name:QUANT": sources.py). Reading one never
downloads: a repo id is looked up in the local hub cache only. What a name looks like decides which
error makes sense when nothing is there: a path that "does not exist", or a
repo that "is not downloaded".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The hub's `org/name` form (huggingface_hub's validate_repo_id, less its
# finer rules: a name that passes this and is wrong fails there, clearly).
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a config or a command may name instead of a path (the names and their
# paths: engines/checkpoints/builtin.py, which builds some on first use).
BUILTIN_PREFIX = "builtin:"
# Models other tools keep (sources.py), and llama.cpp's `-hf org/name:QUANT`.
STORE_PREFIXES = ("ollama:", "lmstudio:")
REPO_QUANT = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<quant>[\w.-]+)$")
_TRUE = {"1", "ON", "YES", "TRUE"}  # how huggingface_hub reads its boolean variables


def looks_local(name: str) -> bool:
    """Whether `name` can only mean a local file or directory: absolute,
    ./ ../ ~, more than the one slash of `org/name`, not a valid repo id
    although it has a slash, or a .gguf file (never a repo); never a store
    name (sources.py)."""
    if name.startswith(STORE_PREFIXES) or REPO_QUANT.match(name):
        return False
    if name in (".", "..") or name.startswith(("./", "../", "~")) or os.path.isabs(name):
        return True
    if os.sep != "/" and os.sep in name:
        return True
    if name.lower().endswith(".gguf"):
        return True
    return "/" in name and not REPO_ID.match(name)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as the hub library reads it, but read now: tests and
    users set it after huggingface_hub may have read it at import."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def cached_snapshot(repo_id: str) -> Path | None:
    """The local hub cache's snapshot of `repo_id` (main, else the newest), or None."""
    try:
        from huggingface_hub import scan_cache_dir, try_to_load_from_cache
    except ImportError:
        return None
    # Both read only the cache directory; neither touches the network.
    try:
        hit = try_to_load_from_cache(repo_id, "config.json")
        if isinstance(hit, str):
            return Path(hit).parent
        cache = scan_cache_dir()
    except Exception:  # a name the hub rejects, no cache directory (CacheNotFound), ...
        return None
    for repo in cache.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model" and repo.revisions:
            # Prefer what `main` points at, else the newest revision.
            revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
            return Path(revs[-1].snapshot_path)
    return None


def not_downloaded(repo_id: str, what: str = "") -> str:
    """The message for a repo id that is neither a local path nor in the cache."""
    offline = " (HF_HUB_OFFLINE is set)" if hub_offline() else ""
    return (f"{repo_id} is not a local path and is not downloaded: it is not in the local "
            f"Hugging Face cache{offline}. {what}Fetch it first (`hf download {repo_id}`) or "
            "give a local path")
