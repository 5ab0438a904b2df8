"""One prefix cache per loaded model, shared by every engine that serves it.

mlx-lm's LRUPromptCache does the work (a token trie of cache snapshots, LRU
eviction); this adds the lock that engines on different worker threads need,
and the rule for an exact hit: the last prompt token must still be fed to get
its logits, which a hybrid model's untrimmable recurrent state cannot undo.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache


class PrefixCache:
    def __init__(self, key: str, max_size: int = 8):
        self.key = key
        self._lru = LRUPromptCache(max_size=max_size)
        self._lock = threading.Lock()

    def resize(self, max_size: int) -> None:
        with self._lock:
            self._lru.max_size = max_size
            self._lru.trim_to(n_sequences=max_size)

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """(a private copy of the nearest cache or None, the tokens it lacks);
        the rest is never empty."""
        if self._lru.max_size == 0:
            return None, tokens
        with self._lock:
            cache, rest = self._lru.fetch_nearest_cache(self.key, tokens)
        if cache is not None and not rest:
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                return cache, tokens[-1:]
            return None, tokens
        return cache, rest

    def insert(self, tokens: list[int], cache: list[Any], kind: str = "assistant") -> None:
        if self._lru.max_size == 0 or not tokens:
            return
        # Evaluate here, on the producing engine's thread: a lazy array's graph
        # names that thread's stream (mlx-lm's generation stream is thread-local),
        # and another engine's worker could not evaluate it ("There is no
        # Stream(cpu, N) in current thread").
        mx.eval([c.state for c in cache])
        with self._lock:
            self._lru.insert_cache(self.key, list(tokens), cache, cache_type=kind)
