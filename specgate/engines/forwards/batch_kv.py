"""One layer's KV cache for a batch of sequences, each at its own length.

Why (issue 45, speculation inside the decode batch): a batched verify feeds
every sequence [last, d_1..d_k] at once, and each keeps a different number
of those rows (its own accepted drafts plus one). mlx-lm's `BatchKVCache`
keeps one write column for the whole batch (rows aligned at the right,
left-padded), so cutting rows back per sequence would mean moving every
sequence's history. Here each sequence has its own length, an array on the
device, as `kv_buffer.DeviceOffsetKV` keeps one for a single sequence:

- row b's new keys and values are written at its own offset (a scatter
  over the new rows), into a buffer whose columns are positions: column j
  holds position j of every sequence, with no padding before a sequence;
- attention sees the whole buffer through a mask per sequence (column c is
  visible to query row r of sequence b iff c <= offset_b + r), so a column
  past a sequence's length, stale or never written, weighs exactly 0;
- `keep(kept)` sets each offset to the start of the last write plus its
  own kept count: the rejected rows stay in the buffer, hidden, and the
  next write goes over them. Nothing moves, and nothing needs the host;
- RoPE reads `offset` (one position a sequence), as mlx-lm's attention
  does for its batch cache.

A sequence joins from its own mlx-lm `KVCache` (`from_caches`) and leaves
as one (`sequence`), so prefill, the prefix cache and single-sequence
decoding keep their own caches.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from specgate.engines.forwards.kv_buffer import counting


class BatchOffsetKV:
    step = 256

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, bound: int):
        self.keys, self.values = keys, values  # (B, heads, columns, head dim)
        self.offset = offset  # (B,) int32: each sequence's length
        self.bound = bound  # the most any offset can be (known on the host)
        self._last: tuple[mx.array, int] | None = None

    @classmethod
    def from_caches(cls, caches: list[KVCache]) -> BatchOffsetKV:
        """Sequences' own caches (one layer each, none empty) joined into one."""
        lengths = [c.offset for c in caches]
        size = -(-max(lengths) // cls.step) * cls.step
        keys, values = [], []
        for c in caches:
            k, v = c.keys[:, :, : c.offset], c.values[:, :, : c.offset]  # (1, heads, length, dim)
            pad = [(0, 0), (0, 0), (0, size - c.offset), (0, 0)]
            keys.append(mx.pad(k, pad))
            values.append(mx.pad(v, pad))
        offset = mx.array(lengths, dtype=mx.int32)
        return cls(mx.concatenate(keys), mx.concatenate(values), offset, max(lengths))

    def sequence(self, b: int, length: int) -> KVCache:
        """Sequence b (whose length the host knows) as its own cache."""
        c = KVCache()
        c.update_and_fetch(self.keys[b : b + 1, :, :length], self.values[b : b + 1, :, :length])
        return c

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset

    def room(self, n: int) -> None:
        """Columns for `n` more rows after the most any offset can be."""
        size = self.keys.shape[2]
        if self.bound + n <= size:
            return
        grow = -(-(self.bound + n) // self.step) * self.step - size
        pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        self.room(n)
        at = (self.offset[:, None] + counting(n)[None]).reshape(-1, 1, n, 1)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape),
                                      keys.astype(self.keys.dtype), axis=2)  # fmt: skip
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape),
                                        values.astype(self.values.dtype), axis=2)  # fmt: skip
        self._last = (self.offset, n)
        self.offset = self.offset + n
        self.bound += n
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """(B, 1, n, columns): query row r of sequence b sees columns up to
        its own position offset_b + r (the buffer this forward leaves)."""
        self.room(n)
        rows = (self.offset[:, None] + counting(n)[None])[:, :, None]  # (B, n, 1)
        cols = mx.arange(self.keys.shape[2])[None, None]
        mask = cols <= rows
        if window_size is not None:
            mask = mask & (cols > rows - window_size)
        return mask[:, None]

    def keep(self, kept: mx.array) -> None:
        """Sequence b keeps the first kept[b] rows of the last write."""
        start, _ = self._last
        self.offset = start + kept.astype(mx.int32)

    def settle(self, lengths: list[int]) -> None:
        """The host learnt every sequence's length: `bound` comes down to the longest."""
        self.bound = max(lengths)

    def extend(self, other: BatchOffsetKV) -> None:
        """`other`'s sequences after these (sequences joining the batch)."""
        size = max(self.keys.shape[2], other.keys.shape[2])

        def padded(a: mx.array) -> mx.array:
            return mx.pad(a, [(0, 0), (0, 0), (0, size - a.shape[2]), (0, 0)])

        self.keys = mx.concatenate([padded(self.keys), padded(other.keys)])
        self.values = mx.concatenate([padded(self.values), padded(other.values)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.bound = max(self.bound, other.bound)

    def filter(self, indices: list[int]) -> None:
        """Keep only these sequences, in this order (the others left the batch)."""
        at = mx.array(indices, dtype=mx.int32)
        self.keys, self.values, self.offset = self.keys[at], self.values[at], self.offset[at]
