"""The import cache's bookkeeping: a file's sha256, remembered per (path,
size, mtime) so a second start does not read a large file again, and a
lock that keeps two processes from importing one file at once."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CHUNK = 16 << 20


def _index(index: Path) -> dict:
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def known_digest(path: Path, index: Path) -> str | None:
    """The sha256 `index` remembers for `path` at its current size and mtime; None: not known."""
    st = path.stat()
    entry = _index(index).get(str(path))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry.get("sha256")
    return None


def file_digest(path: Path, index: Path) -> str:
    """sha256 of the file at `path`, from `index` when its size and mtime
    are those it was hashed at."""
    if (digest := known_digest(path, index)) is not None:
        return digest
    st = path.stat()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    known = _index(index)
    known[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    tmp = index.with_name(f"{index.name}.{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, index)  # another process's update may be lost: it hashes again, no harm
    return digest


@contextmanager
def locked(lock: Path) -> Iterator[None]:
    """Held by one process at a time (flock: released when the process dies)."""
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
