"""A model's KV cache quantized to 4 or 8 bits (`kv_bits`), on every path its caches take.

mlx-lm's `QuantizedKVCache` stores each new key and value row quantized
(`mx.quantize`, groups along the head dimension, so a row's stored values
depend on that row alone), and mlx-lm's attention reads such a cache with
quantized matmuls (`scaled_dot_product_attention` looks for `bits` on the
cache). Two things are added here:

- `quantize_caches(model, bits, group_size)` hooks the model instance
  specgate loaded: its `make_cache` (which mlx-lm's `make_prompt_cache` asks
  first) gives a `QuantizedKVCache` wherever it gave a plain `KVCache`.
  Every path that makes a fresh cache (the plain engine's lone loop and
  mlx-lm's BatchGenerator, the speculative engines' targets, the prefix
  cache) then quantizes from the first token, so plain decoding and every
  speculative method decode over the same stored values. Layers whose
  cache is something else keep it: a sliding window's `RotatingKVCache`
  (mlx-lm has no quantized one; it is short by construction) and a hybrid's
  recurrent state.
- `BatchQuantizedKV`: mlx-lm's `BatchKVCache` (left padding, the batch's
  shared write column) with quantized rows, so the plain engine's
  continuous batching keeps its batch. mlx-lm's BatchGenerator merges a
  sequence's caches by calling each one's `merge`, which mlx-lm's
  `QuantizedKVCache` lacks: `batchable(cache)` gives the caches the plain
  engine hands the batch that method (on each instance, as a cache read
  back from the prefix cache's disk files is a plain mlx-lm one).

Exactness: a verify forward of k rows writes the same quantized rows as k
one-row steps, and a rollback moves the offset back (mlx-lm's `trim`), so
speculation's output equals plain decoding over the same quantized cache.
"""

from __future__ import annotations

from types import MethodType

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

GROUP_SIZE = 64  # mlx-lm's default

Parts = tuple[mx.array, mx.array, mx.array]  # packed values, scales, biases


def quantize_caches(model, bits: int, group_size: int = GROUP_SIZE) -> None:
    """`make_prompt_cache(model)` from now on quantizes every plain KV cache."""
    stock = model.make_cache if hasattr(model, "make_cache") else None

    def make_cache() -> list:
        fresh = stock() if stock is not None else [KVCache() for _ in model.layers]
        return [QuantizedKVCache(group_size, bits) if type(c) is KVCache else c for c in fresh]

    model.make_cache = make_cache


def group_size_for(text_config: dict, asked: int = GROUP_SIZE) -> int:
    """`asked`, or the largest of MLX's group sizes below it that divides the
    model's head dimension (a group spans part of one head's row)."""
    head = text_config.get("head_dim") or (
        text_config.get("hidden_size", 0) // max(1, text_config.get("num_attention_heads", 1)))
    for size in (asked, 64, 32):
        if size <= asked and head and head % size == 0:
            return size
    raise ValueError(f"kv_bits: the model's head dimension {head} is not a multiple of 32")


def bytes_per_value(bits: int, group_size: int, dtype_bytes: int) -> float:
    """Bytes a quantized cache spends per stored key or value element:
    the packed bits, and a scale and a bias (of the model's type) per group."""
    return bits / 8 + 2 * dtype_bytes / group_size


def batchable(cache: list | None) -> list | None:
    """`cache` with each quantized layer able to join mlx-lm's batch (its `merge`)."""
    for c in cache or ():
        if type(c) is QuantizedKVCache:
            c.merge = MethodType(lambda self, caches: BatchQuantizedKV.merge(caches), c)
    return cache


def _zeros_like_parts(template: Parts, shape: tuple[int, ...]) -> Parts:
    return tuple(mx.zeros((*shape, t.shape[-1]), dtype=t.dtype) for t in template)


class BatchQuantizedKV(BatchKVCache):
    """mlx-lm's BatchKVCache whose keys and values are quantized rows
    (each a (packed, scales, biases) tuple, as QuantizedKVCache keeps them)."""

    def __init__(self, left_padding: list[int], group_size: int, bits: int):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev, n = self._idx, keys.shape[2]
        new_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            steps = (self.step + n - 1) // self.step * self.step
            more_k, more_v = _zeros_like_parts(new_k, (B, H, steps)), _zeros_like_parts(new_v, (B, H, steps))
            if self.keys is None:
                self.keys, self.values = more_k, more_v
            else:
                self.keys = tuple(mx.concatenate([x[..., :prev, :], y], axis=2)
                                  for x, y in zip(self.keys, more_k, strict=True))  # fmt: skip
                self.values = tuple(mx.concatenate([x[..., :prev, :], y], axis=2)
                                    for x, y in zip(self.values, more_v, strict=True))  # fmt: skip
        self.offset = self.offset + n
        self._idx += n
        for stored, new in ((self.keys, new_k), (self.values, new_v)):
            for part, rows in zip(stored, new, strict=True):
                part[..., prev: self._idx, :] = rows
        return self.keys_and_values()

    def keys_and_values(self):
        return (tuple(x[..., : self._idx, :] for x in self.keys),
                tuple(x[..., : self._idx, :] for x in self.values))  # fmt: skip

    def finalize(self) -> None:
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys = tuple(dynamic_roll(x, shift, axis=2) for x in self.keys)
            self.values = tuple(dynamic_roll(x, shift, axis=2) for x in self.values)
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices) -> None:
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., shift:, :] for x in self.keys)
                self.values = tuple(x[..., shift:, :] for x in self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKV) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        template = self if self.keys is not None else other
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def padded(c: BatchQuantizedKV) -> tuple[Parts, Parts, mx.array, mx.array]:
            rows = c.offset.shape[0]
            k = c.keys if c.keys is not None else _zeros_like_parts(template.keys, (rows, template.keys[0].shape[1], 0))
            v = c.values if c.values is not None else _zeros_like_parts(template.values, (rows, template.values[0].shape[1], 0))
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = tuple(x[..., :right, :] for x in k), tuple(x[..., :right, :] for x in v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = tuple(mx.pad(x, widths) for x in k), tuple(mx.pad(x, widths) for x in v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = padded(self), padded(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(self.group_size, self.bits)
        mx.eval(self.left_padding)
        start = self.left_padding.tolist()[idx]
        cache.keys = tuple(mx.contiguous(x[idx: idx + 1, :, start: self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[idx: idx + 1, :, start: self._idx]) for x in self.values)
        cache.offset = self._idx - start
        return batchable([cache])[0]

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKV:
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first.bits)
        full = next((c for c in caches if c.keys is not None), None)
        if longest == 0 or full is None:
            return batch
        heads = full.keys[0].shape[1]
        batch.keys = _zeros_like_parts(full.keys, (len(caches), heads, longest))
        batch.values = _zeros_like_parts(full.values, (len(caches), heads, longest))
        for i, c in enumerate(caches):
            if c.keys is None or c.offset == 0:
                continue
            pad = longest - c.offset
            for stored, own in ((batch.keys, c.keys), (batch.values, c.values)):
                for part, rows in zip(stored, own, strict=True):
                    part[i: i + 1, :, pad:] = rows[..., : c.offset, :]
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))
