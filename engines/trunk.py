"""The target model as a speculative engine needs it, without forking mlx-lm.

mlx-lm's Qwen3.5 / Qwen3-Next inner models already end with the final norm,
so their output is exactly the hidden state the MTP head reads; logits are
the lm_head (or tied embedding) applied to it. `Trunk` just names these.

Hybrid models need one more thing: a verify forward over k+1 tokens must be
undoable to any accepted prefix, and a GatedDeltaNet's conv and recurrent
state cannot be trimmed like a KV cache. Two small hooks record, while a
`tape()` is active on this thread, what each GatedDeltaNet layer saw:
- its conv1d input (previous conv window + the new rows), by giving the
  layer's Conv1d instance a subclass whose __call__ also records the input;
- its recurrent state after every step, by routing mlx-lm's
  `gated_delta_update` (looked up as a module global by both model files)
  through a stepwise version that keeps each step's state.
Outside a tape both hooks do exactly what mlx-lm does. Rolling back is then
picking a slice: no second forward, no weights read again.

Block drafters (DFlash, DSpark) read more than the final hidden state: the
outputs of named decoder layers. `capture(layer_ids)` records them during a
forward, by the same kind of hook: each decoder layer instance gets a
subclass whose __call__ also stores its output while a capture is active.

The other way, `checkpoint` before the verify and `restore` + a replay
forward over the accepted tokens after it, is kept for comparison
(bench/spec_vs_plain.py measures both) and as an independent reference.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from kernels.cache_undo import checkpoint, restore  # noqa: F401 - part of this module's API

_local = threading.local()


@dataclass
class LayerTape:
    conv_input: mx.array | None = None  # (B, K-1+T, C)
    states: list[mx.array] = field(default_factory=list)  # T x (B, Hv, Dv, Dk)


class Tape(list):
    """One LayerTape per GatedDeltaNet layer, in call (= layer) order."""


@contextmanager
def tape():
    """Record GatedDeltaNet inputs and per-step states during the block."""
    _local.tape = Tape()
    try:
        yield _local.tape
    finally:
        _local.tape = None


def _active() -> Tape | None:
    return getattr(_local, "tape", None)


class _TapingConv1d(nn.Conv1d):
    def __call__(self, x: mx.array) -> mx.array:
        if (t := _active()) is not None:
            t.append(LayerTape(conv_input=x))
        return super().__call__(x)


_original_update = gated_delta.gated_delta_update


def _taping_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
    t = _active()
    if t is None:
        return _original_update(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    # mlx-lm's own stepwise recurrence (its ops path), keeping every state.
    beta = mx.sigmoid(b) * (2.0 if kwargs.get("allow_neg_eigval") else 1.0)
    lower = kwargs.get("lower_bound")
    g = (
        gated_delta.compute_g(A_log, a, dt_bias)
        if lower is None
        else gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower)
    )
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (rep := Hv // Hk) > 1:
        q, k = mx.repeat(q, rep, -2), mx.repeat(k, rep, -2)
    ys, states = [], []
    for i in range(T):
        y, state = gated_delta._gated_delta_step_ops(
            q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], state,
            None if mask is None else mask[:, i],
        )  # fmt: skip
        ys.append(y)
        states.append(state)
    t[-1].states = states
    return mx.stack(ys, axis=1), state


@dataclass
class Capture:
    """Outputs of the wanted decoder layers (before the final norm), by index."""

    wanted: frozenset[int]
    outputs: dict[int, mx.array] = field(default_factory=dict)


@contextmanager
def capture(layer_ids):
    """Record the outputs of decoder layers `layer_ids` during the block."""
    _local.capture = Capture(frozenset(layer_ids))
    try:
        yield _local.capture
    finally:
        _local.capture = None


def _capturing_call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    c = getattr(_local, "capture", None)
    if c is not None and self._specgate_layer in c.wanted:
        c.outputs[self._specgate_layer] = out
    return out


_capturing_classes: dict[type, type] = {}


def _install_capture(layers: list[nn.Module]) -> None:
    for i, layer in enumerate(layers):
        cls = type(layer)
        if cls not in _capturing_classes.values():
            sub = _capturing_classes.setdefault(
                cls, type(f"Capturing{cls.__name__}", (cls,), {"__call__": _capturing_call})
            )
            layer.__class__ = sub
        layer._specgate_layer = i


def _install_hooks(model: nn.Module) -> None:
    qwen3_5.gated_delta_update = _taping_update
    qwen3_next.gated_delta_update = _taping_update
    for _, module in model.named_modules():
        if isinstance(module, (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)):
            if type(module.conv1d) is nn.Conv1d:
                module.conv1d.__class__ = _TapingConv1d


class Trunk:
    """Hidden states, logits, embeddings and caches of a Qwen3.5/Qwen3-Next target."""

    def __init__(self, model: nn.Module):
        text = model.language_model if hasattr(model, "language_model") else model
        self.model = model
        self.inner = text.model  # returns hidden states after the final norm
        self._lm_head = None if text.args.tie_word_embeddings else text.lm_head
        # Whether verify forwards run through kernels/hook.py's proved kernels
        # (set by the engine from kernels/wiring.py at load; off by default).
        self.kernels = False
        _install_hooks(model)
        _install_capture(self.inner.layers)

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed(mx.array([[0]])).shape[-1]

    @property
    def vocab_size(self) -> int:
        return self.inner.embed_tokens.weight.shape[0]

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        return self.inner(tokens, cache=cache)

    def logits(self, hidden: mx.array) -> mx.array:
        if self._lm_head is None:
            return self.inner.embed_tokens.as_linear(hidden)
        return self._lm_head(hidden)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)


def rollback(cache: list, recorded: Tape, rejected: int, kept_steps: int) -> None:
    """Undo the last `rejected` tokens of a verify forward.

    kept_steps: tokens of that forward that stay (accepted drafts + the token
    the round started from). KV caches are trimmed; each GatedDeltaNet's conv
    window and recurrent state are set to what they were after `kept_steps`.
    """
    if rejected == 0:
        return
    layers = iter(recorded)
    for c in cache:
        if isinstance(c, ArraysCache):
            lt = next(layers)
            n_keep = lt.conv_input.shape[1] - len(lt.states)
            c[0] = lt.conv_input[:, kept_steps : kept_steps + n_keep]
            c[1] = lt.states[kept_steps - 1]
        elif isinstance(c, KVCache) or hasattr(c, "trim"):
            c.trim(rejected)
