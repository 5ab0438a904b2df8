"""Multi-row forwards that attend over a KV cache's whole buffer, so their shapes repeat.

Why: MLX's CUDA attention sends 2+ query rows to cuDNN, which builds an
execution graph for every new (query, key) shape it meets
(mlx/backend/cuda/scaled_dot_product_attention.cpp keys its graph cache on
the exact key length; an LRU of 256). A speculative round verifies M rows
after a cache that has grown by a different amount every round, so every
round met a new key length and paid a graph build: on an H200 an MTP round
of a 7B model cost 45-90 ms where the same forwards at a repeated length
cost 16 ms (bench/verify_shape_churn.py). MLX avoids this for one row
itself, by attending over the 256-step buffer mlx-lm's `KVCache` keeps and
masking its tail; this does the same for M rows: the forward is handed the
whole buffer as keys and values and an explicit mask that hides the
positions past the cache's end, so the key length changes only when the
buffer grows (every 256 tokens).

Exactness: the hidden positions get -inf before the softmax, so they weigh
exactly 0; the buffer past the end holds zeros or stale finite keys and
values from trimmed rounds, never NaN.

`views(cache, rows)` wraps each plain `KVCache` of a cache list for one
forward of `rows` new tokens (causal attention takes its mask from
`make_mask`, as mlx-lm's models do; attention that sees every key takes
`visible()`); the wrappers write into the caches they wrap
(trim, rollback and the prefix cache see nothing different). Where the
buffer must grow during this forward, the view passes everything through
unchanged. On Metal and the CPU there is no per-shape build and the
padding only costs compute, so engines turn this on only where
`HELPS` (MLX's CUDA backend).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

HELPS = mx.cuda.is_available()
MAX_ROWS = 64  # verify and drafter widths; prefill chunks keep mlx-lm's path


class WholeBufferKV:
    """One KVCache as seen by one forward of `rows` new tokens."""

    def __init__(self, cache: KVCache, rows: int):
        self.cache = cache
        buffer = cache.keys
        # Decided before the forward, for its mask and for every layer alike:
        # a buffer that grows during this forward changes shape anyway.
        self.whole = buffer is not None and cache.offset + rows <= buffer.shape[2]

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = self.cache.update_and_fetch(keys, values)
        if self.whole:
            return self.cache.keys, self.cache.values
        return k, v

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        c = self.cache
        if not self.whole:
            return c.make_mask(n, return_array=return_array, window_size=window_size)
        rows = mx.arange(c.offset, c.offset + n)[:, None]
        cols = mx.arange(c.keys.shape[2])[None]
        mask = cols <= rows
        if window_size is not None:
            mask = mask & (cols > rows - window_size)
        return mask

    def visible(self) -> mx.array | None:
        """After this forward's update: for attention without a causal part
        (every row sees every key so far, as a DFlash drafter's block does),
        the mask that hides the buffer's tail; None where the keys are not
        the whole buffer."""
        if not self.whole:
            return None
        return mx.arange(self.cache.keys.shape[2]) < self.cache.offset

    def __getattr__(self, name: str):
        # Anything else a model reads of its cache (size, state, ...) is the cache's.
        return getattr(self.cache, name)


def views(cache: list, rows: int) -> list:
    """`cache` with each plain KVCache wrapped for a forward of `rows` tokens
    (unchanged for one row, which MLX handles itself, and for prefill)."""
    if not 2 <= rows <= MAX_ROWS:
        return cache
    return [WholeBufferKV(c, rows) if type(c) is KVCache else c for c in cache]


class DeviceOffsetKV:
    """A KV cache whose length is an array on the device, not a number on
    the host: a forward can be queued before the host knows how many of the
    last forward's rows stand (engines/mlx_spec/ahead.py queues a round
    before the last round's verdict is read).

    Rows are written at the device-side `offset` into a buffer sized for the
    most the offset can be (`bound`, known on the host); attention sees the
    whole buffer through a mask of the positions before the offset, as
    WholeBufferKV does (so a hidden row weighs exactly 0). `offset` is what
    mlx-lm's attention reads for RoPE positions; `keep(n)` sets it to the
    first n rows of the last write; `settle` brings `bound` down once the
    host learns the length."""

    step = 256

    def __init__(self, cache: KVCache):
        self.keys, self.values = cache.keys, cache.values
        self.offset = mx.array(cache.offset, dtype=mx.int32)
        self.bound = cache.offset

    @classmethod
    def of(cls, keys: mx.array, values: mx.array, offset: mx.array, bound: int) -> DeviceOffsetKV:
        c = cls.__new__(cls)
        c.keys, c.values, c.offset, c.bound = keys, values, offset, bound
        return c

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset

    def room(self, n: int) -> None:
        """A buffer for `n` more rows after the most the offset can be
        (every layer's grows alike: the same bound, the same steps)."""
        size = self.keys.shape[2]
        if self.bound + n <= size:
            return
        grow = (self.bound + n + self.step - 1) // self.step * self.step - size
        shape = list(self.keys.shape)
        shape[2] = grow
        self.keys = mx.concatenate([self.keys, mx.zeros(shape, self.keys.dtype)], axis=2)
        shape = list(self.values.shape)
        shape[2] = grow
        self.values = mx.concatenate([self.values, mx.zeros(shape, self.values.dtype)], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        self.room(n)
        # A scatter of the n rows, not `mx.slice_update` at the array offset:
        # MLX's CUDA DynamicSliceUpdate (0.32) launches one thread per element
        # of the whole buffer (each rewriting an element of the update), so a
        # write cost a pass over the buffer: 17 us a layer on an H100, ~1.1
        # ms of an MTP round's GPU time. The scatter's kernel runs over the
        # update's elements only. The row numbers are a constant array (host
        # data, no kernel: `mx.arange` was a launch a layer), one per n, so
        # that a compiled round merges the layers' identical `offset + rows`.
        rows = (self.offset + counting(n)).reshape(1, 1, n, 1)
        self.keys = _write_rows(self.keys, keys, rows)
        self.values = _write_rows(self.values, values, rows)
        self.offset = self.offset + n
        self.bound += n
        self._last = (self.offset - n, n)
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        self.room(n)  # the buffer this forward's update will leave: its key length
        rows = self.offset + mx.arange(n)[:, None]
        cols = mx.arange(self.keys.shape[2])[None]
        mask = cols <= rows
        if window_size is not None:
            mask = mask & (cols > rows - window_size)
        return mask

    def keep(self, n: mx.array | int) -> None:
        """Only the first `n` rows of the last write stand (the rest are
        written over by the next one)."""
        start, _ = self._last
        self.offset = start + n

    def settle(self, length: int, in_flight: int) -> None:
        """The host learnt the cache's length before the writes still in
        flight (`in_flight` rows at most): the bound comes down to it."""
        self.bound = length + in_flight


_COUNTS: dict[int, mx.array] = {}


def counting(n: int) -> mx.array:
    """0..n-1 as a constant int32 array, the same object for every n (made
    from host data: safe to keep across mx.compile traces)."""
    if n not in _COUNTS:
        _COUNTS[n] = mx.array(list(range(n)), dtype=mx.int32)
    return _COUNTS[n]


def _write_rows(buffer: mx.array, new: mx.array, rows: mx.array) -> mx.array:
    """`buffer` with `new`'s rows (axis 2) written at positions `rows` (1, 1, n, 1)."""
    new = new.astype(buffer.dtype)
    return mx.put_along_axis(buffer, mx.broadcast_to(rows, new.shape), new, axis=2)
