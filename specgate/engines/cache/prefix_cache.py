"""One prefix cache per loaded model, shared by every engine that serves it.

An entry is the state after a token prefix: the trunk's caches (KV, and a
hybrid's recurrent and conv state) and, per drafter that made or met it, the
drafter's own state at the same point (`DrafterState`: the MTP head's cache,
a block drafter's context cache and the features it is still owed). A
request resumes from the longest usable entry and feeds only the rest; a
drafter without its state in the entry starts blind on the cached prefix
(acceptance may dip for a few rounds; nothing is re-prefilled).

What is usable:
- an entry whose tokens are a prefix of the request's: as is, drafter state
  included (the trunk's cache must leave at least one token to feed: the
  last prompt token's logits come from that forward);
- a longer entry, or one that diverges, only where every trunk cache can be
  trimmed (all-KV models): cut back to the common prefix, drafter state
  dropped. A hybrid's recurrent state cannot be cut, nor a sliding window
  (Gemma-4's rotating caches) once it has wrapped: there the engines take
  snapshots at the prompt's message boundaries (GenerationRequest.boundaries).

Scopes keep keys apart (the gateway names a request's scope): an entry is
used only by its own scope, except entries inserted as shared (a system
prompt's snapshot), which any scope uses, and only whole, as an exact
prefix. So a key learns through timing at most that someone sent exactly
the same system prompt, never how far another key's text matches its own.

Memory: every model's cache draws on one RAM budget (`CacheBudget`), least
recently used entries evicted first across models; the entry count per
model is capped too. A disk tier (engines/cache/prefix_disk.py) gets every entry
as it is inserted (written behind, on its own thread), so what RAM evicts and
what a restart loses is still there; it has its own byte budget.

mlx-lm's LRUPromptCache is not used: it has no room for a drafter's state
beside the trunk's, no scopes, no budget shared across models and no disk
tier; its eviction and trie would be the smaller part of this module.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

log = logging.getLogger(__name__)

SHARED = "*"  # the scope of entries any scope may use whole (a system prompt's)


@dataclass
class DrafterState:
    """A proposer's state after the same prefix as the trunk's caches
    (Proposer.snapshot / restore): its caches, and named arrays."""

    caches: list = field(default_factory=list)
    arrays: dict[str, mx.array] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) + sum(a.nbytes for a in self.arrays.values())

    def evaluate(self) -> None:
        mx.eval([c.state for c in self.caches], list(self.arrays.values()))


@dataclass
class Hit:
    """What a request starts from: a private copy of the trunk's caches (None:
    nothing cached) holding the first `cached` tokens, and its drafter's state."""

    cache: list | None
    cached: int
    drafter: DrafterState | None = None
    tier: str = "none"  # "ram" | "disk" | "none"


@dataclass
class Entry:
    tokens: np.ndarray  # int32
    trunk: list
    scope: str
    drafters: dict[str, DrafterState] = field(default_factory=dict)
    used: int = 0  # the budget's clock at the last use
    # Fixed once the entry is made (lookups and the budget read them often).
    trimmable: bool = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.trimmable = can_trim_prompt_cache(self.trunk)
        self.nbytes = sum(c.nbytes for c in self.trunk)
        for state in self.drafters.values():
            self.nbytes += state.nbytes

    def add_drafters(self, drafters: dict[str, DrafterState]) -> None:
        for name, state in drafters.items():
            old = self.drafters.get(name)
            self.nbytes += state.nbytes - (old.nbytes if old is not None else 0)
            self.drafters[name] = state


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def usable_length(entry_tokens: np.ndarray, entry_scope: str, trimmable: bool,
                  tokens: np.ndarray, scope: str) -> tuple[int, bool]:  # fmt: skip
    """How many of `tokens` an entry can serve to `scope`, and whether whole
    (drafter state kept). 0: none."""
    if entry_scope not in (scope, SHARED):
        return 0, False
    n, common = len(entry_tokens), common_prefix(entry_tokens, tokens)
    if common == n and n < len(tokens):
        return n, True
    if entry_scope != scope or not trimmable:
        return 0, False
    return min(common, len(tokens) - 1), False


@dataclass
class CacheStats:
    """Cumulative counts, read by the gateway's /metrics at each scrape."""

    lookups: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})  # by tier
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})
    evictions: int = 0  # from RAM (the disk tier counts its own)
    restores: int = 0  # entries loaded from disk
    restore_seconds: float = 0.0  # their loading, in all


class CacheBudget:
    """One RAM budget over every model's prefix cache: after an insert, the
    least recently used entries anywhere go until the total fits."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._clock = itertools.count(1)
        # Weakly: a model's cache leaves the budget with the model (unloaded).
        self._caches: weakref.WeakSet[PrefixCache] = weakref.WeakSet()
        self._lock = threading.Lock()

    def tick(self) -> int:
        return next(self._clock)

    def join(self, cache: PrefixCache) -> None:
        with self._lock:
            self._caches.add(cache)

    def enforce(self) -> None:
        # Never called with a cache's lock held: it takes them one at a time.
        with self._lock:
            caches = list(self._caches)
            while caches and sum(c.nbytes for c in caches) > self.max_bytes:
                oldest = min(caches, key=lambda c: c.oldest_use())
                if not oldest.evict_oldest():
                    break


def default_budget() -> CacheBudget:
    """An eighth of physical memory (unified memory on Apple silicon)."""
    from specgate.engines.memory import physical_memory

    return CacheBudget(physical_memory() // 8)


_shared_budget: CacheBudget | None = None


def shared_budget() -> CacheBudget:
    global _shared_budget
    if _shared_budget is None:
        _shared_budget = default_budget()
    return _shared_budget


def set_ram_budget(max_bytes: int) -> None:
    """The server's `prefix_cache.ram_bytes`; applies to caches made from now on and now."""
    shared_budget().max_bytes = max_bytes
    shared_budget().enforce()


class PrefixCache:
    def __init__(self, key: str, max_entries: int = 64, *, budget: CacheBudget | None = None,
                 disk=None, cache_classes: tuple[str, ...] = (),
                 trimmable: bool = True, snapshot_interval: int = 4096):  # fmt: skip
        """disk: an specgate.engines.cache.prefix_disk.DiskTier (None: RAM only).
        cache_classes: the trunk's cache classes, what a disk entry must hold.
        trimmable: whether the model's caches can be cut back (all KV).
        snapshot_interval: see snapshot_points."""
        self.key = key
        self.trimmable = trimmable
        self.snapshot_interval = snapshot_interval
        self.max_entries = max_entries
        self.budget = budget or shared_budget()
        self.disk = disk
        self.cache_classes = cache_classes
        self.stats = CacheStats()
        self._entries: dict[tuple[str, bytes], Entry] = {}
        self._lock = threading.Lock()
        self.budget.join(self)

    # -- sizes --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, max_entries: int) -> None:
        with self._lock:
            self.max_entries = max_entries
            while len(self._entries) > max_entries:
                self._evict_locked()

    def oldest_use(self) -> float:
        with self._lock:
            return min((e.used for e in self._entries.values()), default=float("inf"))

    def evict_oldest(self) -> bool:
        with self._lock:
            return self._evict_locked()

    def _evict_locked(self) -> bool:
        if not self._entries:
            return False
        k = min(self._entries, key=lambda k: self._entries[k].used)
        self._entries.pop(k)
        self.stats.evictions += 1
        return True

    # -- lookups ------------------------------------------------------------------------

    def fetch(self, tokens: list[int], scope: str = "", drafter: str | None = None) -> Hit:
        """The longest usable state for `tokens` (a private copy), from RAM
        or disk; Hit(None, 0) when there is none. At least one token is
        always left to feed."""
        if self.max_entries == 0 or len(tokens) < 2:
            return Hit(None, 0)
        want = np.asarray(tokens, dtype=np.int32)
        with self._lock:
            self.stats.lookups += 1
            best, length, whole = None, 0, False
            for entry in self._entries.values():
                n, w = usable_length(entry.tokens, entry.scope, entry.trimmable, want, scope)
                better = n > length or (n == length and n and w and drafter in entry.drafters)
                if better:
                    best, length, whole = entry, n, w
            tier = "ram"
            if self.disk is not None:
                found = self.disk.best(want, scope, length)
                if found is not None:
                    restored = self._restore(found)
                    if restored is not None:
                        n, w = usable_length(restored.tokens, restored.scope, restored.trimmable,
                                             want, scope)  # fmt: skip
                        if n > length:
                            best, length, whole, tier = restored, n, w, "disk"
            if best is None:
                return Hit(None, 0)
            best.used = self.budget.tick()
            cache = copy.deepcopy(best.trunk)
            state = copy.deepcopy(best.drafters.get(drafter)) if whole and drafter else None
            self.stats.hits[tier] += 1
            self.stats.hit_tokens[tier] += length
        if tier == "disk":
            self.budget.enforce()
        if length < len(best.tokens):
            trim_prompt_cache(cache, len(best.tokens) - length)
        return Hit(cache, length, state, tier)

    def _restore(self, found) -> Entry | None:
        """A disk entry loaded into RAM (lock held); None if it was refused."""
        t0 = time.perf_counter()
        entry = self.disk.load(found, self.cache_classes)
        if entry is None:
            return None
        self.stats.restores += 1
        self.stats.restore_seconds += time.perf_counter() - t0
        self._put_locked(entry, restored=True)
        return entry

    def snapshot_points(self, request, cached: int) -> list[int]:
        """Where a prefill of `request` (a GenerationRequest) keeps snapshots."""
        if self.max_entries == 0:
            return []
        return snapshot_points(len(request.prompt_tokens), cached, request.boundaries,
                               request.shared_prefix, self.trimmable, self.snapshot_interval)  # fmt: skip

    def snapshot_scope(self, request, length: int) -> str:
        """The scope a snapshot of `request`'s first `length` tokens goes to."""
        return SHARED if length == request.shared_prefix else request.cache_scope

    # -- inserts ------------------------------------------------------------------------

    def insert(self, tokens: list[int], trunk: list[Any], scope: str = "", *,
               drafter: str | None = None, drafter_state: DrafterState | None = None) -> None:  # fmt: skip
        """Keep `trunk` (the caches after `tokens`; the cache takes them: the
        caller must not change them after) and, for `drafter`, its state."""
        if self.max_entries == 0 or not tokens:
            return
        # Evaluate here, on the producing engine's thread: a lazy array's graph
        # names that thread's stream (mlx-lm's generation stream is thread-local),
        # and another thread could not evaluate it ("There is no Stream(cpu, N)
        # in current thread").
        mx.eval([c.state for c in trunk])
        if drafter_state is not None:
            drafter_state.evaluate()
        drafters = {drafter: drafter_state} if drafter is not None and drafter_state is not None else {}
        entry = Entry(np.asarray(tokens, dtype=np.int32), trunk, scope, drafters)
        with self._lock:
            self._put_locked(entry)
        self.budget.enforce()

    def _put_locked(self, entry: Entry, restored: bool = False) -> None:
        k = (entry.scope, entry.tokens.tobytes())
        old = self._entries.get(k)
        if old is not None:  # the same state: keep the older trunk, gather the drafters
            old.add_drafters(entry.drafters)
            old.used = self.budget.tick()
            if entry.drafters and self.disk is not None and not restored:
                self.disk.save(old)  # again, with the new drafter's state
            return
        entry.used = self.budget.tick()
        if self.disk is not None and not restored:
            self.disk.save(entry)  # written behind, on the disk tier's thread
        if entry.trimmable:
            # Its prefixes in the same scope are trims of it, unless they hold
            # a drafter's state it lacks.
            for k2, e in list(self._entries.items()):
                if (e.scope == entry.scope and len(e.tokens) < len(entry.tokens)
                        and set(e.drafters) <= set(entry.drafters)
                        and common_prefix(e.tokens, entry.tokens) == len(e.tokens)):  # fmt: skip
                    del self._entries[k2]
        self._entries[k] = entry
        while len(self._entries) > self.max_entries:
            self._evict_locked()


def drafter_id(method: str, directory: str) -> str:
    """A separate drafter's name in entries: its method and weights' digest."""
    from specgate.kernels.tune import checkpoint_digest

    return f"{method}:{checkpoint_digest(directory)}"


def snapshot(cache: list[Any]) -> list[Any]:
    """A copy of caches that keep changing (a prefill continuing past a boundary)."""
    return copy.deepcopy(cache)


def snapshot_points(n_prompt: int, cached: int, boundaries: tuple[int, ...], shared_prefix: int,
                    trimmable: bool, interval: int) -> list[int]:  # fmt: skip
    """Prompt offsets, past what the cache served, after which a prefill keeps
    a snapshot: the system prompt's end (shared) and the prompt but its last
    token (an identical retry); where the trunk cannot be cut back, also each
    message boundary and every `interval` tokens, so a request that shares
    only part of this prompt resumes near where it diverges."""
    points = {shared_prefix, n_prompt - 1}
    if not trimmable:
        points.update(boundaries)
        if interval > 0:
            points.update(range(interval, n_prompt, interval))
    return sorted(p for p in points if cached < p < n_prompt)
