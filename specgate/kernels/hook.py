"""Route a model's quantized linears through the small-M kernel, without forking model files.

`install(model, guard)` gives every affine 4/8-bit `nn.QuantizedLinear`
instance of *that model* a subclass (as engines/targets/ does for its
tapes; mlx-lm's classes and other models are untouched) whose __call__,
while kernels are on for this thread, sends inputs of
2..16 rows (and one row of a linear WIDE_N wide or more: an lm_head)
through the kernel the guard proved for that exact shape on this machine,
and everything else (other one-row inputs, prefill, shapes the guard
refused or the kernel was not written for) through mlx-lm's own __call__,
unchanged.
Kernels are off until asked for:

    hook.install(model, guard)
    with hook.kernels():          # the verify forward
        logits = model(tokens, cache=cache)

On and off is per thread and per block, never process-wide: an engine
turns them on around its own verify forward only.
The guard proves each new shape at its first use (see kernels/guard.py);
`guard.prove(...)`-style warm-up is just one forward per verify width.

With a second guard for the fused op (`install(model, guard, fused_guard)`,
guard.FUSED_QMM), each group of sibling linears a model calls in a row on
the same input (FUSE_GROUPS: a layer's q/k/v, gate/up) is computed in one
launch by its first member where that guard proved the group's shape; the
others find their output waiting, matched to the very same x object, and
anything else (another x, an unproved shape) takes the per-linear path.
Every launch costs ~10-20 us of host work in MLX, ~200 of them a forward.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from specgate.kernels import qmm, tiles
from specgate.kernels.tiles import TileWatch

_local = threading.local()


def enabled() -> bool:
    return getattr(_local, "on", False)


@contextmanager
def kernels(on: bool = True):
    """Kernels on (or off) for this thread during the block."""
    prev = enabled()
    _local.on = on
    try:
        yield
    finally:
        _local.on = prev


@contextmanager
def one_row(on: bool = True):
    """While kernels are on, one-row products go through the kernels too,
    where the guard proved them at one row, on this thread during the block.
    For what a compiled trace records (engines/forwards/one_row.py's kernel
    halves), where MLX replays the launches from C++: called from Python, a
    custom launch costs the host more than MLX's own one-row kernel
    (bench/plain_probe.py: "mma1" 0.73x `generate_step`, "mmac" 1.14x on an
    H100 whose GPU bounds decoding)."""
    prev = getattr(_local, "one_row", False)
    _local.one_row = on
    try:
        yield
    finally:
        _local.one_row = prev


_UNKNOWN = object()


# A linear at least this wide (an untied lm_head over a vocabulary) goes
# through the guard at one row too, while kernels are on: there MLX's
# one-row `qmv` moves ~0.8 TB/s and the tensor-core kernel ~1.7 (an H100,
# 151936 x 4096 4-bit: 330 against 194 us). The MTP head's drafts are such
# products, one a draft (engines/mlx_spec/ahead_round.py); narrower one-row
# products stay stock, where a custom launch's host cost outweighs it.
WIDE_N = 32768

# Linears of one module that a model calls one after another on the same
# input: one launch computes the group (kernels/qmm_mma.py's fused kernel).
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _KernelQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        d = self.__dict__
        pending = d.get("_specgate_pending")
        if pending is not None:  # a group's first member computed this one already
            d["_specgate_pending"] = None
            if pending[0] is x:
                return pending[1]
        guard = d.get("_specgate_guard")
        m = math.prod(x.shape[:-1])
        one = m == 1 and enabled() and getattr(_local, "one_row", False)
        if m == 1 and not one and (siblings := d.get("_specgate_siblings")) is not None:
            return self._siblings(x, siblings)
        if guard is not None and enabled() and (qmm.MIN_M <= m <= qmm.MAX_M or one
                                                or (m == 1 and self["weight"].shape[0] >= WIDE_N)):
            if d.get("_specgate_group"):
                y = self._fused(x, m)
                if y is not None:
                    return y
            if one and (siblings := d.get("_specgate_siblings")) is not None:
                return self._siblings(x, siblings)  # the group's one stock launch, not three
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
        if tiles.waiting(d.get("_specgate_tiles"), m, x.dtype, self.bits, self.group_size):
            y = tiles.untiled_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size,
                                     self.bits)  # fmt: skip
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)

    def _siblings(self, x: mx.array, siblings: tuple) -> mx.array:
        """One row through the group's joined weights (fuse_siblings): one
        stock launch for the group, each other member's slice left waiting."""
        group, (weight, scales, biases) = siblings
        y = mx.quantized_matmul(x, weight, scales, biases, transpose=True,
                                group_size=self.group_size, bits=self.bits)  # fmt: skip
        start, outs = 0, []
        for mod in group:
            n = mod["weight"].shape[0]
            out = y[..., start : start + n]
            outs.append(out + mod["bias"] if "bias" in mod else out)
            start += n
        for mod, out in zip(group[1:], outs[1:], strict=True):
            mod.__dict__["_specgate_pending"] = (x, out)
        return outs[0]

    def _fused(self, x: mx.array, m: int) -> mx.array | None:
        """This module's group in one launch, where the fused guard proved
        it for this shape: returns this module's output and leaves each
        other member's waiting on it, matched to this very x (None: not
        proved, compute alone)."""
        d = self.__dict__
        group, fguard = d["_specgate_group"], d["_specgate_fused_guard"]
        fns = d["_specgate_fused_fns"]
        args = [a for mod in group for a in (mod["weight"], mod["scales"], mod["biases"])]
        fn = fns.get((m, x.dtype), _UNKNOWN)
        if fn is _UNKNOWN:
            fn = fns[(m, x.dtype)] = fguard.kernel_for(x, *args, self.group_size, self.bits)
        if fn is None:
            return None
        ys = fn(x, *args, self.group_size, self.bits)
        ys = [y + mod["bias"] if "bias" in mod else y for mod, y in zip(group, ys, strict=True)]
        for mod, y in zip(group[1:], ys[1:], strict=True):
            mod.__dict__["_specgate_pending"] = (x, y)
        return ys[0]


def eligible(module: nn.Module) -> bool:
    return (type(module) in (nn.QuantizedLinear, _KernelQuantizedLinear)
            and getattr(module, "mode", "affine") == "affine"
            and module.bits in qmm.BITS and module.get("biases") is not None)  # fmt: skip


def fuse_groups(model: nn.Module) -> list[list[nn.Module]]:
    """Sibling linears (FUSE_GROUPS) of one module that share their input
    size, bits, group size and scale dtype."""
    out = []
    for _, parent in model.named_modules():
        for names in FUSE_GROUPS:
            mods = [parent.get(n) if isinstance(parent, nn.Module) else None for n in names]
            if not all(mod is not None and eligible(mod) for mod in mods):
                continue
            sig = {(mod["weight"].shape[1], mod.bits, mod.group_size, mod["scales"].dtype)
                   for mod in mods}  # fmt: skip
            if len(sig) == 1:
                out.append(mods)
    return out


def fuse_siblings(model: nn.Module) -> int:
    """Each FUSE_GROUPS group of `model` computes a one-row input (decoding)
    in one stock `quantized_matmul` over the members' weights joined,
    instead of one launch per member; returns how many groups.

    Why: a decoding step is bound by the host's work per launch on a GPU
    (~20 launches a layer, each costing MLX ~10 us to encode), and a
    layer's q/k/v and gate/up are three of them. Exact: every output column
    is the same dot product over the same packed weights, whichever matrix
    holds its row. The members' weights, scales and biases become slices of
    the joined arrays (no second copy in memory), so their own path (more
    rows: prefill, batches, verify kernels) is unchanged. Only one row: for
    more, the slices of the joined output are not contiguous and the
    reshapes after q/k/v would copy them."""
    groups = 0
    for group in fuse_groups(model):
        if any("_specgate_joined" in mod.__dict__ for mod in group):
            continue
        joined = []
        for name in ("weight", "scales", "biases"):
            whole = mx.concatenate([mod[name] for mod in group])
            start = 0
            for mod in group:
                n = mod[name].shape[0]
                mod[name] = whole[start : start + n]
                start += n
            joined.append(whole)
        mx.eval(joined, [mod.parameters() for mod in group])
        for mod in group:
            if type(mod) is nn.QuantizedLinear:
                mod.__class__ = _KernelQuantizedLinear
                mod.__dict__.setdefault("_specgate_guard", None)
                mod.__dict__.setdefault("_specgate_fns", {})
            mod.__dict__["_specgate_joined"] = True
        group[0].__dict__["_specgate_siblings"] = (group, tuple(joined))
        groups += 1
    return groups


def install(model: nn.Module, guard, fused_guard=None) -> int:
    """Hook every eligible quantized linear of `model` to `guard` (and, with
    a `fused_guard`, each FUSE_GROUPS group to it); returns how many linears."""
    count = 0
    for _, module in model.named_modules():
        if eligible(module):
            module.__class__ = _KernelQuantizedLinear
            module.__dict__["_specgate_guard"] = guard
            module.__dict__["_specgate_fns"] = {}
            count += 1
    if fused_guard is not None:
        for group in fuse_groups(model):
            group[0].__dict__.update(_specgate_group=group, _specgate_fused_guard=fused_guard,
                                     _specgate_fused_fns={})  # fmt: skip
    return count


def watch_tiles(model: nn.Module, watch: TileWatch) -> int:
    """Every eligible quantized linear of `model` computes a product of
    TILE_ROWS rows or more without MLX's tile (tiles.untiled_matmul) while
    `watch` says that tile is not built yet; returns how many."""
    count = 0
    for _, module in model.named_modules():
        if eligible(module):
            if type(module) is nn.QuantizedLinear:
                module.__class__ = _KernelQuantizedLinear
                module.__dict__.setdefault("_specgate_guard", None)
                module.__dict__.setdefault("_specgate_fns", {})
            module.__dict__["_specgate_tiles"] = watch
            count += 1
    return count


def uninstall(model: nn.Module) -> None:
    """Undo `install` (a model whose siblings are fused, or whose tiles are
    watched, keeps that)."""
    for _, module in model.named_modules():
        if type(module) is _KernelQuantizedLinear:
            if "_specgate_joined" in module.__dict__ or "_specgate_tiles" in module.__dict__:
                module.__dict__["_specgate_guard"] = None
                module.__dict__["_specgate_fns"] = {}
                for key in ("_specgate_group", "_specgate_fused_guard", "_specgate_fused_fns"):
                    module.__dict__.pop(key, None)
                continue
            module.__class__ = nn.QuantizedLinear
            for key in ("_specgate_guard", "_specgate_fns", "_specgate_group", "_specgate_fused_guard",
                        "_specgate_fused_fns", "_specgate_pending"):  # fmt: skip
                module.__dict__.pop(key, None)
