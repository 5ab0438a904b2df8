"""Undoing a forward on mlx-lm caches, cheaply.

A forward appends to KV caches (trimmed back) and replaces the recurrent
(GatedDeltaNet) layers' arrays, never writing them in place, so keeping the
references is enough to undo it. `specgate tune` (kernels/tune.py) times
forwards this way; the engines' checkpoint-and-replay rollback
(engines/targets/base.py) rests on it too.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache


def checkpoint(cache: list) -> list:
    """What `restore` needs: KV offsets, and the recurrent layers' arrays."""
    return [list(c.cache) if isinstance(c, ArraysCache) else c.offset for c in cache]


def restore(cache: list, saved: list) -> None:
    for c, s in zip(cache, saved, strict=True):
        if isinstance(c, ArraysCache):
            c.cache = list(s)
        else:
            c.trim(c.offset - s)
