"""Gemma-4 (mlx-lm `gemma4_text`; `gemma4` wraps it): sliding-window layers beside full ones.

Three things set Gemma-4 apart from the generic adapter:
- its sliding-attention layers keep a `RotatingKVCache` of `sliding_window`
  entries. Once the window has wrapped, a trim cannot bring back the
  entries a verify overwrote or dropped, so a forward run with
  `undo="tape"` keeps each rotating cache's arrays and counters from before
  it (a multi-token update concatenates into new arrays, never writing the
  old ones), and rollback puts them back and appends the kept rows again:
  the same keys and values, at the same positions, as if only the kept
  tokens had been fed;
- its logits are soft-capped (`final_logit_softcapping`), and its
  embedding output is the table row times sqrt(hidden_size);
- its assistant drafter (engines/drafting/assistant/) attends to the K/V of the
  last cache-owning layer of each attention type: `drafter_kv` hands out
  those caches' arrays as they are, with the mask that picks what a query
  at the next position may see.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from mlx_lm.models.gemma4_text import logit_softcap

from specgate.engines.targets.base import KV_CACHES, Forward, TransformerTarget, Undo


class Gemma4Target(TransformerTarget):
    def __init__(self, model: nn.Module):
        super().__init__(model)
        text = model.language_model if hasattr(model, "language_model") else model
        self.args = text.args
        self.softcap = text.final_logit_softcapping
        self.embed_scale = self.inner.embed_scale
        n_owning = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        # The cache a drafter reads per attention type: the last layer of that
        # type that keeps one (KV-shared layers reuse the same arrays).
        self.kv_layer = {kind: i for i, kind in enumerate(self.args.layer_types[:n_owning])}

    def check_caches(self) -> None:
        bad = {type(c).__name__ for c in self.make_cache()
               if type(c) not in (*KV_CACHES, RotatingKVCache)}  # fmt: skip
        if bad:
            raise ValueError(f"{type(self.model).__module__}: caches {sorted(bad)} cannot be "
                             "cut back exactly after a verify")

    def forward(self, tokens: mx.array, cache: list, *, layers=(), undo: Undo | None = None,
                embeddings: mx.array | None = None) -> Forward:  # fmt: skip
        before = None
        if undo == "tape":
            before = [_rotating_state(c) if type(c) is RotatingKVCache else None for c in cache]
        forward = super().forward(tokens, cache, layers=layers, undo=undo, embeddings=embeddings)
        if embeddings is not None and -1 in forward.layers:  # the model scales what it is given
            forward.layers[-1] = embeddings * self.embed_scale
        if before is not None:
            forward.undo = ("tape", before)
        return forward

    def cut(self, cache: list, tape: list, rejected: int, kept: int) -> None:
        fed = kept + rejected
        for c, before in zip(cache, tape, strict=True):
            if before is None:
                c.trim(rejected)
                continue
            # The rows this forward appended are the last `fed` of the buffer
            # (a multi-row update concatenates them in order).
            keys, values = c.keys[..., -fed:, :][..., :kept, :], c.values[..., -fed:, :][..., :kept, :]
            c.keys, c.values, c.offset, c._idx = before
            c.update_and_fetch(keys, values)

    def logits(self, hidden: mx.array) -> mx.array:
        out = super().logits(hidden)
        return out if self.softcap is None else logit_softcap(self.softcap, out)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens) * self.embed_scale

    def drafter_kv(self, cache: list, window: int) -> dict[str, tuple[mx.array, mx.array, mx.array | None]]:
        """Per attention type: (keys, values, mask) of its last cache-owning
        layer, for queries at the cache's next position: every key before it
        for full attention, the `window - 1` latest for sliding attention (as
        the target's own query there sees them, less itself). The arrays are
        the cache's own (a slice at most); the mask is over their slots."""
        out = {}
        for kind, i in self.kv_layer.items():
            c = cache[i]
            n = c.offset
            if type(c) is RotatingKVCache:
                pos = _slot_positions(c)
                seen = (pos >= max(0, n - window + 1)) & (pos < n)
                out[kind] = (c.keys, c.values, seen)
            elif type(c) is QuantizedKVCache:  # (kv_bits) read back at the model's precision
                keys, values = (mx.dequantize(*(x[..., :n, :] for x in parts), group_size=c.group_size,
                                              bits=c.bits) for parts in (c.keys, c.values))  # fmt: skip
                out[kind] = (keys, values, None)
            else:
                out[kind] = (c.keys[..., :n, :], c.values[..., :n, :], None)
        return out


def _rotating_state(c: RotatingKVCache) -> tuple:
    return c.keys, c.values, c.offset, c._idx


def _slot_positions(c: RotatingKVCache) -> mx.array:
    """The absolute position each slot of a rotating cache's buffer holds
    (negative: a slot not written yet). Slots before `_idx` hold the latest
    tokens in order; those from `_idx` on, older ones (a wrapped buffer) or
    nothing (one still growing)."""
    size, idx, n = c.keys.shape[2], c._idx, c.offset
    j = mx.arange(size)
    return mx.where(j < idx, n - idx + j, n - idx - size + j)


Adapter = Gemma4Target
