"""Undoing a forward on mlx-lm caches, cheaply.

A forward appends to KV caches (trimmed back) and replaces the recurrent
(GatedDeltaNet) layers' arrays, never writing them in place, so keeping the
references is enough to undo it. A rotating (sliding-window) cache cannot be
trimmed once it has wrapped: its arrays and counters are kept instead (a
multi-row update concatenates into new arrays; a one-row update writes the
slot of a token that has left the window, which nothing after the undo reads). `specgate tune` (kernels/tune.py) times
forwards this way; the engines' checkpoint-and-replay rollback
(engines/targets/base.py) rests on it too.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache, RotatingKVCache


def checkpoint(cache: list) -> list:
    """What `restore` needs: KV offsets, the recurrent layers' arrays, the
    rotating caches' arrays and counters."""
    return [list(c.cache) if isinstance(c, ArraysCache)
            else (c.keys, c.values, c.offset, c._idx) if isinstance(c, RotatingKVCache)
            else c.offset for c in cache]  # fmt: skip


def restore(cache: list, saved: list) -> None:
    for c, s in zip(cache, saved, strict=True):
        if isinstance(c, ArraysCache):
            c.cache = list(s)
        elif isinstance(c, RotatingKVCache):
            c.keys, c.values, c.offset, c._idx = s
        else:
            c.trim(c.offset - s)
