"""Qwen3.5 / Qwen3.6 hybrids (mlx-lm `qwen3_5`): GatedDeltaNet layers beside attention.

A verify forward over k+1 tokens must be undoable to any accepted prefix,
and a GatedDeltaNet's conv and recurrent state cannot be trimmed like a KV
cache. So while a forward runs with `undo="tape"`, each GatedDeltaNet layer
of *this model* records what it saw:
- its conv1d input (previous conv window + the new rows): its Conv1d
  instance gets a subclass whose __call__ also records the input;
- its recurrent state after every step: the layer instance gets a subclass
  whose __call__ is mlx-lm's own `__call__` (the same code object) bound to
  a private copy of its module's namespace in which `gated_delta_update` is
  a stepwise version that keeps each step's state. mlx-lm's module, its
  classes and any other model in the process are untouched.
Without a tape both do exactly what mlx-lm does. Rolling back is then
picking a slice: no second forward, no weights read again.
"""

from __future__ import annotations

import types

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, qwen3_5
from mlx_lm.models.cache import ArraysCache

from specgate.engines.targets.base import KV_CACHES, TransformerTarget, recording, swap_class


class LayerTape:
    def __init__(self, conv_input: mx.array):
        self.conv_input = conv_input  # (B, K-1+T, C)
        self.states: list[mx.array] = []  # T x (B, Hv, Dv, Dk)


def _tape() -> list | None:
    r = recording()
    return None if r is None else r.tape


class _TapingConv1d(nn.Conv1d):
    def __call__(self, x: mx.array) -> mx.array:
        if (t := _tape()) is not None:
            t.append(LayerTape(x))
        return super().__call__(x)


def _taping_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
    t = _tape()
    if t is None:
        return gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
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


def _taping_subclass(cls: type) -> type:
    call = cls.__call__
    namespace = dict(call.__globals__, gated_delta_update=_taping_update)
    taping = types.FunctionType(call.__code__, namespace, call.__name__, call.__defaults__,
                                call.__closure__)  # fmt: skip
    taping.__kwdefaults__ = call.__kwdefaults__
    return type(f"Taping{cls.__name__}", (cls,), {"__call__": taping})


_taping_classes: dict[type, type] = {}  # ours, one per mlx-lm GatedDeltaNet class
_conv_classes: dict[type, type] = {nn.Conv1d: _TapingConv1d}


class HybridTarget(TransformerTarget):
    """A model with GatedDeltaNet layers of class `recurrent` (ArraysCache:
    conv window, recurrent state) among its attention layers (KVCache)."""

    recurrent: type = qwen3_5.GatedDeltaNet

    def __init__(self, model: nn.Module):
        super().__init__(model)
        for _, module in model.named_modules():
            if isinstance(module, self.recurrent):
                swap_class(module, _taping_classes, _taping_subclass)
                if type(module.conv1d) is nn.Conv1d:
                    swap_class(module.conv1d, _conv_classes, None)

    def check_caches(self) -> None:
        bad = {type(c).__name__ for c in self.make_cache() if type(c) not in (*KV_CACHES, ArraysCache)}
        if bad:
            raise ValueError(f"{type(self.model).__module__}: caches {sorted(bad)} cannot be "
                             "cut back exactly after a verify")

    def cut(self, cache: list, tape: list, rejected: int, kept: int) -> None:
        """KV caches trim; each GatedDeltaNet's conv window and recurrent
        state are set to what they were after `kept` steps."""
        layers = iter(tape)
        for c in cache:
            if isinstance(c, ArraysCache):
                lt = next(layers)
                n_keep = lt.conv_input.shape[1] - len(lt.states)
                c[0] = lt.conv_input[:, kept : kept + n_keep]
                c[1] = lt.states[kept - 1]
            else:
                c.trim(rejected)

    def keep(self, cache: list, forward, kept: mx.array) -> None:
        """`cut` with `kept` on the device: the conv window and recurrent
        state after `kept` steps, picked by device-side indexing."""
        layers = iter(forward.undo[1])
        for c in cache:
            if isinstance(c, ArraysCache):
                lt = next(layers)
                size = list(lt.conv_input.shape)
                size[1] -= len(lt.states)
                c[0] = mx.slice(lt.conv_input, kept.reshape(1), axes=(1,), slice_size=size)
                c[1] = mx.take(mx.stack(lt.states), kept - 1, axis=0)
            else:
                c.keep(kept)

    def keep_rows(self, cache: list, forward, kept: mx.array) -> None:
        """`keep` for a batch of sequences (mlx_spec/batch_decoder.py): row
        b's conv window and recurrent state after its own `kept[b]` steps
        (kept: (B,) on the device). Its attention layers keep their own
        rows (forwards/batch_kv.py)."""
        layers = iter(forward.undo[1])
        for c in cache:
            if isinstance(c, ArraysCache):
                lt = next(layers)
                window = lt.conv_input.shape[1] - len(lt.states)
                at = kept[:, None] + mx.arange(window)[None]  # (B, window)
                c[0] = mx.take_along_axis(lt.conv_input, at[..., None], axis=1)
                states = mx.stack(lt.states, axis=1)  # (B, T, Hv, Dv, Dk)
                c[1] = mx.take_along_axis(states, (kept - 1).reshape(-1, 1, 1, 1, 1), axis=1)[:, 0]


Adapter = HybridTarget
