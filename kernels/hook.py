"""Route a model's quantized linears through the small-M kernel, without forking model files.

`install(model, guard)` gives every affine 4/8-bit `nn.QuantizedLinear` of
the model a subclass (the same trick engines/trunk.py uses for its tapes)
whose __call__, while kernels are on for this thread, sends inputs of
2..16 rows through the kernel the guard proved for that exact shape on this
machine, and everything else (M = 1, prefill, shapes the guard refused or
the kernel was not written for) through mlx-lm's own __call__, unchanged.
Kernels are off until asked for:

    hook.install(model, guard)
    with hook.kernels():          # the verify forward
        logits = model(tokens, cache=cache)

or `hook.set_default(True)` to have them on everywhere (e.g. a benchmark).
The guard proves each new shape at its first use (see kernels/guard.py);
`guard.prove(...)`-style warm-up is just one forward per verify width.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from kernels import qmm

_local = threading.local()
_default = False


def set_default(on: bool) -> None:
    """Kernels on (or off) for every thread that did not say otherwise."""
    global _default
    _default = on


def enabled() -> bool:
    on = getattr(_local, "on", None)
    return _default if on is None else on


@contextmanager
def kernels(on: bool = True):
    """Kernels on (or off) for this thread during the block."""
    prev = getattr(_local, "on", None)
    _local.on = on
    try:
        yield
    finally:
        _local.on = prev


_UNKNOWN = object()


class _KernelQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        d = self.__dict__
        guard = d.get("_specgate_guard")
        m = math.prod(x.shape[:-1])
        if guard is not None and enabled() and qmm.MIN_M <= m <= qmm.MAX_M:
            # The guard's answer per (rows, dtype), kept on the module: a verify
            # forward asks ~200 times, and a verdict never changes once given.
            fns = d["_specgate_fns"]
            fn = fns.get((m, x.dtype), _UNKNOWN)
            if fn is _UNKNOWN:
                fn = fns[(m, x.dtype)] = guard.kernel_for(
                    x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
            if fn is not None:
                y = fn(x, self["weight"], self["scales"], self["biases"], self.group_size,
                       self.bits)  # fmt: skip
                return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


def eligible(module: nn.Module) -> bool:
    return (type(module) in (nn.QuantizedLinear, _KernelQuantizedLinear)
            and getattr(module, "mode", "affine") == "affine"
            and module.bits in qmm.BITS and module.get("biases") is not None)  # fmt: skip


def install(model: nn.Module, guard) -> int:
    """Hook every eligible quantized linear of `model` to `guard`; returns how many."""
    count = 0
    for _, module in model.named_modules():
        if eligible(module):
            module.__class__ = _KernelQuantizedLinear
            module.__dict__["_specgate_guard"] = guard
            module.__dict__["_specgate_fns"] = {}
            count += 1
    return count


def uninstall(model: nn.Module) -> None:
    for _, module in model.named_modules():
        if type(module) is _KernelQuantizedLinear:
            module.__class__ = nn.QuantizedLinear
            module.__dict__.pop("_specgate_guard", None)
            module.__dict__.pop("_specgate_fns", None)
