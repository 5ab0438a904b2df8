"""A decoder layer's one-row step as two compiled halves around its KV cache
write and its attention.

Why: on a GPU host with a slow CPU, decoding a 7B model is bound by the
host. Each layer is ~20 kernels, each built by a Python module call and
then encoded by MLX. On such an H100 host, mlx-lm's `generate_step` spent
2.4 ms building and 4.6 ms encoding a token. A compiled function is
replayed from C++, and MLX fuses its elementwise chains. With the halves,
those times were 1.4 ms and 3.5 ms, at 1.11x `generate_step`'s tok/s
(bench/plain_probe.py, "layerc"). Where the GPU bounds decoding (a faster
host), they measured 1.00x: no gain, no loss.

Why not the whole layer: the attention stays outside the trace. Compiled,
it would see whole KV buffers and a mask. That loses MLX's one-row
attention kernel: a compiled one-token forward ran at 0.82x (docs/DESIGN.md).

Scope:
- the layers of the mlx-lm families in FAMILIES, whose block is
  `h = x + attn(norm(x)); h + mlp(norm(h))` with q/k/v/o projections
  (and qwen3's q/k norms);
- only one row (batch 1, one token);
- only on mlx-lm's own `KVCache`;
- only with no mask.

Everything else (prefill, batches, verify windows, other caches) takes
the stock call. `compile_one_row` checks each layer's halves against its
stock call on a probe row. It keeps them only where the output and the
cache are bit-equal, so a trace that rounds differently is never used.

`compile_one_row_kernels` gives the same layers a second pair, traced
with their products through the proved small-M kernels at one row (the
plain engine does it once they are proved: engines/mlx_plain/kernels.py),
used while the caller's `enabled()` says kernels are on; each is checked
bit for bit against the same halves run uncompiled.

May import mlx and mlx-lm only.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

log = logging.getLogger(__name__)

# mlx-lm model modules whose decoder blocks have the shape above.
FAMILIES = frozenset({"llama", "qwen2", "qwen3"})


class _Offsets:
    """The cache offset as an array, one a token, shared by a model's layers
    (an array per layer would be one more host-to-device copy each)."""

    def __init__(self) -> None:
        self.value, self.array = -1, None

    def of(self, offset: int) -> mx.array:
        if offset != self.value:
            self.value, self.array = offset, mx.array(offset)
        return self.array


def _halves(layer: nn.Module):
    """The layer's one-row step before and after its cache write and
    attention, uncompiled."""
    attn = layer.self_attn
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

    def before(x: mx.array, offset: mx.array):
        h = layer.input_layernorm(x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q, k = q.reshape(1, 1, attn.n_heads, -1), k.reshape(1, 1, attn.n_kv_heads, -1)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(1, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    def after(x: mx.array, attended: mx.array) -> mx.array:
        h = x + attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(1, 1, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return before, after


def _one_row(x: mx.array, mask, cache) -> bool:
    return type(cache) is KVCache and mask is None and x.shape[0] == 1 and x.shape[1] == 1


def _step(layer: nn.Module, halves, offsets: _Offsets, x: mx.array, cache) -> mx.array:
    before, after = halves
    q, k, v = before(x, offsets.of(cache.offset))
    k, v = cache.update_and_fetch(k, v)
    attended = scaled_dot_product_attention(q, k, v, cache=cache, scale=layer.self_attn.scale,
                                            mask=None)  # fmt: skip
    return after(x, attended)


def _compiled_class(stock: type) -> type:
    def __call__(self, x, mask=None, cache=None):
        if not _one_row(x, mask, cache):
            return stock.__call__(self, x, mask, cache)
        d = self.__dict__
        before, after, offsets = d["_specgate_one_row"]
        kernels = d.get("_specgate_one_row_kernels")
        if kernels is not None and kernels[2]():  # traced through the kernels, and they are on
            return _step(self, kernels[:2], offsets, x, cache)
        return _step(self, (before, after), offsets, x, cache)

    return type(f"OneRow{stock.__name__}", (stock,), {"__call__": __call__})


def _same_as_stock(layer: nn.Module, stock: type, dtype, hidden: int) -> bool:
    """One probe row on a cache holding three: the compiled halves' output and
    cache against the stock call's, bit for bit."""
    row, caches = _probe(layer, hidden, dtype)
    return _same(stock.__call__(layer, row, None, caches[0]), layer(row, None, caches[1]), caches)


def _probe(layer: nn.Module, hidden: int, dtype) -> tuple[mx.array, tuple[KVCache, KVCache]]:
    """A probe row, and two caches each holding the same three rows (the
    layer's stock call fed them: more than one row)."""
    key = mx.random.key(7)
    prefix = mx.random.normal((1, 3, hidden), key=key).astype(dtype)
    row = mx.random.normal((1, 1, hidden), key=mx.random.split(key)[1]).astype(dtype)
    caches = KVCache(), KVCache()
    for cache in caches:
        layer(prefix, "causal", cache)
    return row, caches


def _same(want: mx.array, got: mx.array, caches: tuple[KVCache, KVCache]) -> bool:
    """Output and caches bit for bit."""
    same = [mx.array_equal(want, got), *(mx.array_equal(a, b) for a, b in
                                         zip(caches[0].state, caches[1].state, strict=True))]  # fmt: skip
    return all(s.item() for s in same)


def compile_one_row(model: nn.Module) -> int:
    """Give each decoder layer of `model` (a FAMILIES family) its compiled
    one-row halves where they are bit-equal to its stock call; returns how
    many layers have them."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if family not in FAMILIES or not layers:
        return 0
    offsets, classes, done = _Offsets(), {}, 0
    dtype = inner.embed_tokens(mx.array([[0]])).dtype
    for layer in layers:
        stock = type(layer)
        if "_specgate_one_row" in layer.__dict__:
            done += 1
            continue
        try:
            before, after = _halves(layer)
            layer.__dict__["_specgate_one_row"] = (mx.compile(before), mx.compile(after), offsets)
            layer.__class__ = classes.setdefault(stock, _compiled_class(stock))
            if _same_as_stock(layer, stock, dtype, layer.input_layernorm.weight.shape[-1]):
                done += 1
                continue
            log.info("one-row halves differ from %s's stock call: stock kept", stock.__name__)
        except Exception:  # a layer that does not fit the pattern keeps its stock call
            log.info("one-row halves do not fit %s: stock kept", stock.__name__, exc_info=True)
        layer.__class__ = stock
        layer.__dict__.pop("_specgate_one_row", None)
    return done


def compile_one_row_kernels(model: nn.Module, enabled, tracing) -> int:
    """Give each layer that has its compiled one-row halves a second pair,
    traced inside `tracing()` (the context in which the hook sends one-row
    products through the proved kernels: kernels/hook.one_row) and used
    while `enabled()`; returns how many layers have them.

    Why: MLX's one-row quantized kernel (`qmv`) moved ~0.7 TB/s on an
    H100, the tensor-core kernel about twice that; called from Python a
    custom launch costs the host more than it saves, but inside a compiled
    trace MLX replays it from C++ (bench/plain_probe.py "mmac": 1.14x
    `generate_step` where the GPU bounds decoding). Each pair is kept only
    where it gives bit for bit what the same halves give uncompiled inside
    `tracing()`, output and cache, on a probe row; its numbers are then
    the kernels', as the guard proved them at one row."""
    inner = getattr(model, "model", None)
    layers = [layer for layer in getattr(inner, "layers", None) or []
              if "_specgate_one_row" in layer.__dict__]  # fmt: skip
    if not layers:
        return 0
    dtype = inner.embed_tokens(mx.array([[0]])).dtype
    done = 0
    for layer in layers:
        layer.__dict__.pop("_specgate_one_row_kernels", None)
        offsets = layer.__dict__["_specgate_one_row"][2]
        try:
            raw = _halves(layer)
            compiled = tuple(mx.compile(f) for f in raw)
            with tracing():
                row, caches = _probe(layer, layer.input_layernorm.weight.shape[-1], dtype)
                want = _step(layer, raw, offsets, row, caches[0])
                if _same(want, _step(layer, compiled, offsets, row, caches[1]), caches):
                    layer.__dict__["_specgate_one_row_kernels"] = (*compiled, enabled)
                    done += 1
                else:
                    log.info("one-row kernel halves differ from their uncompiled run: not used")
        except Exception:  # the stock halves stay
            log.info("one-row kernel halves failed to trace: not used", exc_info=True)
    return done
