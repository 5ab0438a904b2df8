"""A one-token forward compiled once and replayed (`mx.compile`), for a lone decode.

Why: on a GPU a 7B step is host-bound. mlx-lm's `generate_step` builds the
forward's graph in Python every token (~2 ms of module calls for ~560
kernels) and MLX then encodes every kernel. A compiled function is traced
once; each later call replays the traced graph from C++ (no Python module
calls) with elementwise chains fused into fewer kernels.

Compilation keys on the inputs' shapes, and a Python int inside the trace
is a constant. A KVCache's slice `keys[..., :offset, :]` changes shape every
token, so the forward here never slices: each layer's keys and values are
whole buffers of a fixed size (grown 256 rows at a time, as mlx-lm's
KVCache does, so a new trace every 256 tokens), the next row is written at
an offset held in an array (`mx.slice_update`), and attention sees the whole
buffer through a mask of the positions up to that offset: a hidden row
weighs exactly 0, so the logits are the uncompiled forward's.

Only plain KVCache layers qualify (`fits`): a model with rotating, quantized
or recurrent caches decodes uncompiled. The caches go back to mlx-lm's
KVCache unchanged (`caches()`), so the batch, a handoff or the prefix cache
take them as if this had never run.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

STEP = 256  # rows a buffer grows by (mlx-lm's KVCache.step)


class _Layer:
    """One layer's cache as the traced forward sees it."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        at = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), at, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        rows = self.offset + mx.arange(n)[:, None]
        cols = mx.arange(self.keys.shape[2])[None]
        mask = cols <= rows
        if window_size is not None:
            mask = mask & (cols > rows - window_size)
        return mask


def fits(cache: list) -> bool:
    """Every layer a plain KVCache that holds rows already (the buffers' dtype
    and head shapes come from them)."""
    return bool(cache) and all(type(c) is KVCache and c.keys is not None for c in cache)


class CompiledForward:
    """The model's one-token forward, compiled. One per model and engine: a
    trace is kept per buffer size and reused by every later sequence."""

    def __init__(self, model):
        def forward(token, offset, *kv):
            layers = len(kv) // 2
            views = [_Layer(kv[i], kv[layers + i], offset) for i in range(layers)]
            logits = model(token.reshape(1, 1), cache=views)[:, -1, :]
            return (logits, offset + 1, *[v.keys for v in views], *[v.values for v in views])

        self.run = mx.compile(forward)


class CompiledDecode:
    """A sequence's caches, decoded one token per call through a compiled
    forward. `cache`: the target's KVCache list holding the sequence so far
    (taken over: `caches()` gives it back)."""

    def __init__(self, forward: CompiledForward, cache: list[KVCache]):
        self.forward = forward
        self.length = cache[0].offset
        self.keys = [c.keys for c in cache]
        self.values = [c.values for c in cache]
        self.offset = mx.array(self.length, dtype=mx.int32)

    def _room(self) -> None:
        size = self.keys[0].shape[2]
        if self.length + 1 <= size:
            return
        grow = (self.length + 1 + STEP - 1) // STEP * STEP - size

        def grown(a: mx.array) -> mx.array:
            shape = list(a.shape)
            shape[2] = grow
            return mx.concatenate([a, mx.zeros(shape, a.dtype)], axis=2)

        self.keys = [grown(a) for a in self.keys]
        self.values = [grown(a) for a in self.values]

    def __call__(self, token: mx.array) -> mx.array:
        """Feed one token (shape (1,)); the next token's logits, shape (1, vocab)."""
        self._room()
        layers = len(self.keys)
        logits, self.offset, *kv = self.forward.run(token, self.offset, *self.keys, *self.values)
        self.keys, self.values = kv[:layers], kv[layers:]
        self.length += 1
        return logits

    def caches(self) -> list[KVCache]:
        """The sequence's caches as mlx-lm's KVCache, holding `length` rows."""
        out = []
        for k, v in zip(self.keys, self.values, strict=True):
            c = KVCache()
            c.keys, c.values, c.offset = k, v, self.length
            out.append(c)
        return out
