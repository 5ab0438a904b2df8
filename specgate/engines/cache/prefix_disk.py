"""The prefix cache's disk tier: entries that outlive RAM and restarts.

One directory per model content (`prefix_digest`: the checkpoint's sampled
digest and its tokenizer), one safetensors file per entry, written by
mlx-lm's `save_prompt_cache` (the trunk's caches, then each drafter's, then
its named arrays as one ArraysCache) with a JSON record in the metadata:
the model digest, the scope, the tokens and which caches are whose. The
file is named by the sha256 of its bytes, so a flipped bit or a cut file
is found at load; a file that fails any check (hash, record, digest, the
trunk's cache classes) is refused: deleted, with a log line, never loaded.

Writes happen behind the engines, on this tier's own thread (a 4k-token
prompt of an 8B model is ~0.6 GB); a backlog past WRITE_QUEUE drops the
write, not the request. The tier has its own byte budget: past it, the
least recently used files go (a load touches its file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, load_prompt_cache, save_prompt_cache

from specgate.engines.cache.prefix_cache import DrafterState, Entry, usable_length

log = logging.getLogger(__name__)

FORMAT = 1
WRITE_QUEUE = 8
TMP_SUFFIX = ".tmp.safetensors"
RECORD_KEY = "0.specgate"  # where save_prompt_cache's flattening puts our metadata key


def prefix_digest(model_dir: str | Path) -> str:
    """What decides whether a cached state is valid for a model: its
    weights (specgate.kernels.tune's sampled checkpoint digest) and its tokenizer."""
    from specgate.kernels.tune import checkpoint_digest

    model_dir = Path(model_dir)
    h = hashlib.sha256(checkpoint_digest(model_dir).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        f = model_dir / name
        if f.exists():
            h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class DiskRecord:
    path: Path
    tokens: np.ndarray
    scope: str
    trimmable: bool
    nbytes: int
    used: float  # mtime: the last write or load


class DiskTier:
    def __init__(self, directory: Path, digest: str, max_bytes: int, min_tokens: int = 256):
        """directory: the tier's root ($SPECGATE_HOME/prefix-cache); this
        model's files live under directory/digest. Entries shorter than
        min_tokens are not written: they are cheaper to prefill than to load."""
        self.dir = Path(directory) / digest
        self.digest = digest
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.evictions = 0
        self.refused = 0
        self._index: dict[tuple[str, bytes], DiskRecord] = {}
        self._lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._scan()
        threading.Thread(target=self._writer, name=f"prefix-disk-{digest}", daemon=True).start()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    # -- reading ------------------------------------------------------------------------

    def _scan(self) -> None:
        if not self.dir.is_dir():
            return  # made at the first write
        for path in sorted(self.dir.glob("*.safetensors")):
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            record = self._read_record(path)
            if record is not None:
                self._index[(record.scope, record.tokens.tobytes())] = record
        if self._index:
            log.info("prefix cache %s: %d entries on disk (%.1f MB)", self.digest,
                     len(self._index), self.nbytes / 1e6)  # fmt: skip

    def _refuse(self, path: Path, why: str) -> None:
        self.refused += 1
        log.warning("prefix cache: refused %s (%s); deleted", path, why)
        path.unlink(missing_ok=True)

    def _read_record(self, path: Path) -> DiskRecord | None:
        """The record in a file's header (the data is checked at load)."""
        try:
            with path.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= 64 << 20:
                    raise ValueError(f"header length {n}")
                header = json.loads(f.read(n))
            meta = json.loads(header["__metadata__"][RECORD_KEY])
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')}")
            if meta.get("digest") != self.digest:
                raise ValueError(f"made for model {meta.get('digest')}, not {self.digest}")
            tokens = np.asarray(meta["tokens"], dtype=np.int32)
            return DiskRecord(path, tokens, str(meta["scope"]), bool(meta["trimmable"]),
                              path.stat().st_size, path.stat().st_mtime)  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._refuse(path, f"unreadable record: {e}")
            return None

    def best(self, want: np.ndarray, scope: str, at_least: int) -> DiskRecord | None:
        """The record serving the most of `want` to `scope`, if more than `at_least`."""
        with self._lock:
            records = list(self._index.values())
        best, length = None, at_least
        for r in records:
            n, _ = usable_length(r.tokens, r.scope, r.trimmable, want, scope)
            if n > length:
                best, length = r, n
        return best

    def load(self, record: DiskRecord, cache_classes: tuple[str, ...]) -> Entry | None:
        """The entry in `record`'s file, every check passed (else None: refused)."""
        path = record.path
        try:
            data = path.read_bytes()
        except OSError as e:
            self._drop(record)
            log.warning("prefix cache: %s could not be read (%s)", path, e)
            return None
        if hashlib.sha256(data).hexdigest() != path.stem:
            self._drop(record)
            self._refuse(path, "its bytes do not match its hash")
            return None
        try:
            caches, metadata = load_prompt_cache(str(path), return_metadata=True)
            meta = json.loads(metadata["specgate"])
            n_trunk = meta["trunk"]
            trunk = caches[:n_trunk]
            classes = tuple(type(c).__name__ for c in trunk)
            if cache_classes and classes != cache_classes:
                raise ValueError(f"caches {classes}, the model makes {cache_classes}")
            if meta["tokens"] != record.tokens.tolist() or meta["digest"] != self.digest:
                raise ValueError("its record changed since it was indexed")
            drafters, at = {}, n_trunk
            for d in meta["drafters"]:
                state = DrafterState(caches[at : at + d["caches"]])
                at += d["caches"]
                if d["arrays"]:
                    arrays = caches[at].cache
                    state.arrays = dict(zip(d["arrays"], arrays, strict=True))
                    at += 1
                drafters[d["id"]] = state
            entry = Entry(record.tokens, trunk, record.scope, drafters)
            # Loaded on the engine's thread: evaluate now, so any other thread
            # can use the arrays (see PrefixCache.insert).
            mx.eval([c.state for c in entry.trunk])
            for state in entry.drafters.values():
                state.evaluate()
        except Exception as e:  # anything wrong inside the file: not loaded
            self._drop(record)
            self._refuse(path, f"its contents do not check: {e}")
            return None
        os.utime(path)
        record.used = path.stat().st_mtime
        return entry

    def _drop(self, record: DiskRecord) -> None:
        with self._lock:
            self._index.pop((record.scope, record.tokens.tobytes()), None)

    # -- writing ------------------------------------------------------------------------

    def save(self, entry: Entry) -> None:
        """Write `entry` behind the caller (its arrays are evaluated and no
        longer change)."""
        if len(entry.tokens) < self.min_tokens or self.max_bytes <= 0:
            return
        try:
            self._writes.put_nowait(entry)
        except queue.Full:
            log.debug("prefix cache %s: disk writes behind; one skipped", self.digest)

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._writes.join()

    def close(self) -> None:
        """No more writes: the queued ones finish, then the writer thread ends."""
        self._writes.put(None)

    def _writer(self) -> None:
        while True:
            entry = self._writes.get()
            if entry is None:
                self._writes.task_done()
                return
            try:
                self._write(entry)
            except OSError as e:  # a full or read-only disk: this entry stays in RAM only
                log.warning("prefix cache %s: a disk write failed (%s)", self.digest, e)
            except Exception:
                log.exception("prefix cache %s: a disk write failed", self.digest)
            finally:
                self._writes.task_done()

    def _write(self, entry: Entry) -> None:
        caches, drafters = list(entry.trunk), []
        for drafter_id, state in entry.drafters.items():
            caches += state.caches
            names = list(state.arrays)
            if names:
                arrays = ArraysCache(len(names))
                arrays.cache = [state.arrays[n] for n in names]
                caches.append(arrays)
            drafters.append({"id": drafter_id, "caches": len(state.caches), "arrays": names})
        meta = {"format": FORMAT, "digest": self.digest, "scope": entry.scope,
                "tokens": entry.tokens.tolist(), "trimmable": entry.trimmable,
                "trunk": len(entry.trunk), "drafters": drafters}  # fmt: skip
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
        try:
            save_prompt_cache(str(tmp), caches, {"specgate": json.dumps(meta)})
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            path = self.dir / f"{digest}.safetensors"
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # still there only if the write failed
        key = (entry.scope, entry.tokens.tobytes())
        record = DiskRecord(path, entry.tokens, entry.scope, entry.trimmable,
                            path.stat().st_size, path.stat().st_mtime)  # fmt: skip
        with self._lock:
            old = self._index.get(key)
            self._index[key] = record
        if old is not None and old.path != path:
            old.path.unlink(missing_ok=True)
        self._enforce()

    def _enforce(self) -> None:
        with self._lock:
            victims = []
            total = sum(r.nbytes for r in self._index.values())
            for key, r in sorted(self._index.items(), key=lambda kv: kv[1].used):
                if total <= self.max_bytes:
                    break
                victims.append(r)
                total -= r.nbytes
                del self._index[key]
        for r in victims:
            r.path.unlink(missing_ok=True)
            self.evictions += 1
