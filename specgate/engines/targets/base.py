"""What a speculative decoder needs of its target model, and the generic adapter.

`Target` is the protocol every family adapter implements (engines/targets/
has one module per mlx-lm model file that needs more than the generic one):
- `forward(tokens, cache, layers=..., undo=...)` -> a `Forward`: the hidden
  states after the final norm, the outputs of the named decoder layers (-1:
  the embedding output) that a drafter reads, and, with `undo`, what
  `rollback` needs to cut the forward back to any prefix of its inputs;
- `logits`, `embed`, `make_cache`;
- `verify_kernels()`: the context in which a verify forward (and its logits)
  runs through the small-M kernels, where the engine enabled them.

`TransformerTarget` serves every model whose caches are all KVCaches (dense
attention: Qwen3, Llama, ...): rollback is a trim. Hybrid families subclass
it (engines/targets/qwen3_5.py).

Named layers are captured by giving each decoder-layer *instance* of this
model a subclass whose __call__ also stores its output while this thread
captures. Only this model's layers are touched; mlx-lm's classes and
modules are not, so a second model in the process runs mlx-lm unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from specgate.engines.forwards import kv_buffer
from specgate.kernels import hook
from specgate.kernels.cache_undo import checkpoint, restore

# How a verify forward is undone: "tape" records what rollback needs during
# the forward (no second pass); "replay" restores the caches and runs the
# kept inputs again (the independent reference, and bench/spec_vs_plain's
# comparison).
Undo = Literal["tape", "replay"]


@dataclass
class Forward:
    """One trunk forward over `tokens` (1, T)."""

    tokens: mx.array
    hidden: mx.array  # (1, T, H), after the final norm
    layers: dict[int, mx.array] = field(default_factory=dict)  # named layer -> (1, T, H)
    undo: object | None = None  # the adapter's record for `rollback`
    cache: list | None = None  # the caches it ran on (a drafter reading the trunk's K/V keeps them)


class Target(Protocol):
    num_layers: int
    hidden_size: int
    vocab_size: int
    kernels: bool  # verify forwards through kernels/hook.py (set by the engine)
    whole_buffer: bool  # multi-row forwards over whole KV buffers (engines/forwards/kv_buffer.py)

    def forward(self, tokens: mx.array, cache: list, *, layers: Collection[int] = (),
                undo: Undo | None = None, embeddings: mx.array | None = None) -> Forward:
        """`embeddings` (1, T, H): the inputs in place of the tokens' own
        (a prompt's images, engines/vision/)."""
        ...  # fmt: skip

    def rollback(self, cache: list, forward: Forward, kept: int) -> None:
        """Cut the caches back to the first `kept` inputs of `forward`
        (which ran with `undo`), exactly."""
        ...

    def logits(self, hidden: mx.array) -> mx.array: ...

    def embed(self, tokens: mx.array) -> mx.array: ...

    def make_cache(self) -> list: ...

    def verify_kernels(self): ...


_local = threading.local()


def recording():
    """This thread's active recorder (set by a forward), or None."""
    return getattr(_local, "recorder", None)


@contextmanager
def _recording(recorder):
    prev, _local.recorder = recording(), recorder
    try:
        yield recorder
    finally:
        _local.recorder = prev


@dataclass
class Recorder:
    """What hooked modules record during one forward on this thread."""

    wanted: frozenset[int]
    layers: dict[int, mx.array] = field(default_factory=dict)
    tape: list | None = None  # per recurrent layer, when undoing by tape


def _capturing_call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    r = recording()
    if r is not None and self._specgate_layer in r.wanted:
        r.layers[self._specgate_layer] = out
    return out


_capturing_classes: dict[type, type] = {}  # ours, one per mlx-lm layer class


def swap_class(module: nn.Module, subclasses: dict[type, type], make) -> None:
    """Give this one instance a subclass of its class (made once per class by
    `make(cls)`), unless it has one already."""
    cls = type(module)
    if cls in subclasses.values():
        return
    if cls not in subclasses:
        subclasses[cls] = make(cls)
    module.__class__ = subclasses[cls]


# A plain KV cache, or one quantized (the model's `kv_bits`: engines/forwards/
# quantized_kv.py): either is cut back by moving its offset.
KV_CACHES = (KVCache, QuantizedKVCache)


class TransformerTarget:
    """A model whose caches are all KVCaches: hidden states, logits,
    embeddings, named-layer capture; rollback trims."""

    def __init__(self, model: nn.Module):
        text = model.language_model if hasattr(model, "language_model") else model
        self.model = model
        self.inner = text.model  # returns hidden states after the final norm
        self._lm_head = None if text.args.tie_word_embeddings else text.lm_head
        # Tensor parallel (mlx-lm's shard()): each rank's head makes a slice
        # of the vocabulary, gathered as mlx-lm's own __call__ gathers it.
        self._head_group = getattr(text, "sharding_group", None)
        # Whether verify forwards run through kernels/hook.py's proved kernels
        # (set by the engine from kernels/wiring.py at load; off by default).
        self.kernels = False
        # Whether multi-row forwards attend over the KV caches' whole buffers
        # (engines/forwards/kv_buffer.py: where each new key length costs a build).
        self.whole_buffer = kv_buffer.HELPS
        for i, layer in enumerate(self.inner.layers):
            if layer is None:  # another rank's, in a pipeline (mlx-lm's pipeline())
                continue
            swap_class(layer, _capturing_classes,
                       lambda cls: type(f"Capturing{cls.__name__}", (cls,),
                                        {"__call__": _capturing_call}))  # fmt: skip
            layer._specgate_layer = i
        self.check_caches()

    def check_caches(self) -> None:
        bad = {type(c).__name__ for c in self.make_cache() if type(c) not in KV_CACHES}
        if bad:
            raise ValueError(f"{type(self.model).__module__}: caches {sorted(bad)} cannot be "
                             "cut back exactly after a verify (no target adapter for them)")

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed(mx.array([[0]])).shape[-1]  # a quantized embedding packs its weight

    @property
    def vocab_size(self) -> int:
        return self.inner.embed_tokens.weight.shape[0]

    def forward(self, tokens: mx.array, cache: list, *, layers: Collection[int] = (),
                undo: Undo | None = None, embeddings: mx.array | None = None) -> Forward:  # fmt: skip
        wanted = frozenset(i for i in layers if i >= 0)
        saved = checkpoint(cache) if undo == "replay" else None
        recorder = Recorder(wanted, tape=[] if undo == "tape" else None)
        seen = kv_buffer.views(cache, tokens.shape[1]) if self.whole_buffer else cache
        given = {} if embeddings is None else {"input_embeddings": embeddings}
        with _recording(recorder) if wanted or undo == "tape" else nullcontext():
            hidden = self.inner(tokens, cache=seen, **given)
        first = self.embed(tokens) if embeddings is None else embeddings
        captured = {i: first if i < 0 else recorder.layers[i] for i in layers}
        record = ("replay", saved) if undo == "replay" else ("tape", recorder.tape) if undo else None
        return Forward(tokens, hidden, captured, record, cache)

    def rollback(self, cache: list, forward: Forward, kept: int) -> None:
        rejected = forward.tokens.shape[1] - kept
        if rejected == 0:
            return
        how, record = forward.undo
        if how == "replay":
            restore(cache, record)
            self.inner(forward.tokens[:, :kept], cache=cache)
        else:
            self.cut(cache, record, rejected, kept)

    def cut(self, cache: list, tape: list, rejected: int, kept: int) -> None:
        """Tape rollback: the adapter's own caches; KV caches trim."""
        for c in cache:
            c.trim(rejected)

    def keep(self, cache: list, forward: Forward, kept: mx.array) -> None:
        """`rollback` (by tape) with `kept` an array on the device, not yet
        known here (engines/mlx_spec/ahead.py): the KV caches, there
        kv_buffer.DeviceOffsetKVs, keep their first `kept` new rows. An
        adapter that cuts its own caches keeps them its own way too."""
        for c in cache:
            c.keep(kept)

    def logits(self, hidden: mx.array) -> mx.array:
        if self._lm_head is None:
            return self.inner.embed_tokens.as_linear(hidden)
        if self._head_group is not None:
            return gather_last_axis(self._lm_head(hidden), self._head_group)
        return self._lm_head(hidden)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def verify_kernels(self):
        return hook.kernels() if self.kernels else nullcontext()
