"""Qwen-VL's multimodal rotary positions, on mlx-lm's text model.

Qwen3.5 rotates each frequency of a query or key by one of three positions:
time, height or width ("interleaved": frequency i takes height where
i % 3 == 1 and width where i % 3 == 2, within their sections, time
elsewhere). A text token has all three equal, so mlx-lm's text model, which
knows only one position (the cache's offset), is exact on text. An image's
tokens are placed on their grid instead: the t, h, w of each merged patch,
all starting after the text before them; the text after an image continues
from the largest of them plus one, so positions fall behind the token
count by (tokens - max(t, h, w)) per image.

How specgate runs it without a second language model:
- `positions()` is the layout above for a prompt segment (plain function);
- `PositionedRoPE` wraps the rope of each attention layer of *this* model
  instance: inside `at_positions(p)` it rotates by `p` (3, L), elsewhere it
  is mlx-lm's rope unchanged;
- after the segment, `realign()` rotates every cached key forward by the
  positions the segment fell behind. Attention sees only differences of
  positions, and the keys never attend, so from there on the cache is an
  ordinary one whose next position is its length: every engine, batch,
  rollback and prefix-cache entry works on it unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from specgate.engines.base import ImageInput


def positions(length: int, images: Sequence[ImageInput], merge: int) -> tuple[np.ndarray, int]:
    """(3, length) positions of a segment whose images are `images` (their
    starts relative to the segment), and the position after it."""
    out = np.zeros((3, length), dtype=np.int64)
    pos = at = 0
    for image in sorted(images, key=lambda i: i.start):
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        text = image.start - at
        out[:, at : image.start] = pos + np.arange(text)
        pos += text
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        out[:, image.start : image.start + t * h * w] = pos + grid.reshape(3, -1)
        pos += max(t, h, w)
        at = image.start + t * h * w
    out[:, at:] = pos + np.arange(length - at)
    return out, pos + (length - at)


def _component(half: int, section: Sequence[int]) -> np.ndarray:
    """Which of (t, h, w) rotates each of `half` frequencies (interleaved)."""
    which = np.zeros(half, dtype=np.int64)
    i = np.arange(half)
    which[(i % 3 == 1) & (i < 3 * section[1])] = 1
    which[(i % 3 == 2) & (i < 3 * section[2])] = 2
    return which


def rotate(x: mx.array, pos: np.ndarray, dims: int, base: float, section: Sequence[int]) -> mx.array:
    """x (B, H, L, D) rotated in its first `dims` features (rotate-half
    pairing, mlx-lm's `traditional=False`) by the positions pos (3, L)."""
    half = dims // 2
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    chosen = pos[_component(half, section)]  # (half, L)
    angles = mx.array((chosen.T * inv_freq).astype(np.float32))  # (L, half)
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


_local = threading.local()


@contextmanager
def at_positions(pos: np.ndarray | None):
    """Forwards on this thread rotate by `pos` (3, L) plus their cache's
    offset, in every PositionedRoPE."""
    prev, _local.pos = getattr(_local, "pos", None), pos
    try:
        yield
    finally:
        _local.pos = prev


class PositionedRoPE(nn.Module):
    """An attention layer's rope, able to take multimodal positions."""

    def __init__(self, rope: nn.RoPE, section: Sequence[int]):
        super().__init__()
        self.dims, self.base, self.section = rope.dims, rope.base, tuple(section)
        self._rope = rope  # (private: not a child module, so not in the weights' tree)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        pos = getattr(_local, "pos", None)
        if pos is None:
            return self._rope(x, offset=offset)
        return rotate(x, pos + int(offset), self.dims, self.base, self.section)


def attention_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's attention modules, by layer index (its cache's index)."""
    text = model.language_model if hasattr(model, "language_model") else model
    return {i: layer.self_attn for i, layer in enumerate(text.model.layers) if hasattr(layer, "self_attn")}


def install(model: nn.Module, section: Sequence[int]) -> str | None:
    """Give this model instance's attention layers a PositionedRoPE; the
    reason it cannot, or None."""
    layers = attention_layers(model)
    for attn in layers.values():
        rope = attn.rope
        if isinstance(rope, PositionedRoPE):
            continue
        if type(rope) is not nn.RoPE or rope.traditional or rope.scale != 1.0:
            return f"its rope ({type(rope).__name__}) is not a plain rotate-half RoPE"
        attn.rope = PositionedRoPE(rope, section)
    return None if layers else "no attention layers found"


def realign(cache: list, model: nn.Module, behind: int) -> None:
    """After a segment whose positions fell `behind` its token count:
    rotate every attention layer's cached keys forward by that much
    (quantized ones, kv_bits, through a dequantize and a quantize)."""
    if behind == 0:
        return
    shift = np.full((3, 1), behind, dtype=np.int64)
    for i, attn in attention_layers(model).items():
        c, rope = cache[i], attn.rope
        n = c.offset
        if isinstance(c.keys, tuple):  # a quantized cache (kv_bits): packed, scales, biases
            parts = [p[..., :n, :] for p in c.keys]
            keys = mx.dequantize(*parts, group_size=c.group_size, bits=c.bits)
            rotated = rotate(keys, shift, rope.dims, rope.base, rope.section).astype(parts[1].dtype)
            for p, q in zip(c.keys, mx.quantize(rotated, group_size=c.group_size, bits=c.bits),
                            strict=True):  # fmt: skip
                p[..., :n, :] = q
            continue
        c.keys[..., :n, :] = rotate(c.keys[..., :n, :], shift, rope.dims, rope.base, rope.section)
