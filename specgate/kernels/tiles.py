"""While MLX builds its quantized matmul's tile for a row range, a forward
computes that product without it instead of waiting.

Why: on CUDA, MLX's quantized matmul from TILE_ROWS rows up is a CUTLASS
template per row range and precision, built with NVRTC at its first call
(~27 s each on an H100), so a fresh machine's first prompt waited ~50 s
for one (kernels/README.md). kernels/prebuild.py builds those tiles in
worker processes meanwhile; until the one a call needs is built there,
`untiled_matmul` gives the same product through what MLX ships built:
- under SPLIT_BELOW rows (a batch's decode step, a verify), chunks of
  TILE_ROWS - 1 rows through MLX's matrix-vector kernel, each row as a
  lone decode step computes it: a weight read per chunk;
- from it on (a prompt), `mx.dequantize` and a matmul: the weights
  rounded once to the activations' dtype (as a bf16 / f16 model's own
  are), ~9 weight reads' worth of memory traffic, which a long prompt's
  arithmetic hides.
A compiled trace (mx.compile) keeps the branch it took, so the engines
trace under `stock()`: a replayed round never stays on the way round.
Nothing here runs on Metal or a CPU: only where a builder exists
(engines/kernel_wiring.prebuild_forward).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from contextlib import contextmanager

import mlx.core as mx

from specgate.kernels.guard import dtype_name

# MLX's quantized matmul on CUDA below this many rows is its precompiled
# matrix-vector kernel; from it on, a CUTLASS tile built at first use.
TILE_ROWS = 8
# Fewer rows than this go through the matrix-vector kernel in chunks (a
# weight read each) rather than dequantize + matmul (~9 weight reads).
SPLIT_BELOW = 64

_local = threading.local()


@contextmanager
def stock():
    """On this thread during the block, every product takes MLX's own path,
    built or not: what a compiled trace records, since it keeps the branch
    it took for as long as it is replayed."""
    prev = getattr(_local, "stock", False)
    _local.stock = True
    try:
        yield
    finally:
        _local.stock = prev


def waiting(watch: TileWatch | None, rows: int, dtype: mx.Dtype, bits: int, group_size: int) -> bool:
    """Whether a product of `rows` rows should not call MLX's tile now."""
    return (watch is not None and rows >= TILE_ROWS and not getattr(_local, "stock", False)
            and not watch.ready(rows, dtype, bits, group_size))  # fmt: skip


def row_range(rows: int) -> int:
    """The range of row counts one of MLX's tiles likely serves: the next
    power of two, 16 to 256. MLX 0.32's sm_80 path tiles rows by 16, 32
    and 64+, a sm_90 path by 16 to 256: a range this narrow is never
    taken for ready before its own tile is built."""
    return min(256, max(16, 1 << (max(rows, 1) - 1).bit_length()))


class TileWatch:
    """Which of MLX's tiles a model's forwards may call now: those the
    builder's workers built (`built`: the job groups they finished), and
    every one once the builds are `finished` (then MLX builds what is left
    where it is called, as without workers)."""

    def __init__(self, built, finished: threading.Event | Iterable[threading.Event]):
        # () -> the builder's groups: (op, rows, dtype name, bits, group size) for MLX's
        # builds, ("ours", module name) for our compiles, which say nothing of a tile.
        self._built = built
        # Every build batch its tiles are in (one event, or several where
        # another module's prebuild queued some of them first).
        self._finished = (finished,) if isinstance(finished, threading.Event) else tuple(finished)
        self._ready: set[tuple] = set()

    def ready(self, rows: int, dtype: mx.Dtype, bits: int, group_size: int) -> bool:
        key = (row_range(rows), dtype_name(dtype), bits, group_size)
        if key in self._ready or all(e.is_set() for e in self._finished):
            return True
        if any(len(g) == 5 and (row_range(g[1]), *g[2:]) == key for g in self._built()):
            self._ready.add(key)
            return True
        return False


def untiled_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                   group_size: int, bits: int) -> mx.array:  # fmt: skip
    """x @ dequantize(weight)^T without MLX's tiles (the module docstring)."""
    m = math.prod(x.shape[:-1])
    if m >= SPLIT_BELOW:
        return dequantized_matmul(x, weight, scales, biases, group_size, bits)
    x2 = x.reshape(m, x.shape[-1])
    parts = [mx.quantized_matmul(x2[i : i + TILE_ROWS - 1], weight, scales, biases, transpose=True,
                                 group_size=group_size, bits=bits)
             for i in range(0, m, TILE_ROWS - 1)]  # fmt: skip
    return mx.concatenate(parts).reshape(*x.shape[:-1], weight.shape[0])


def dequantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                       group_size: int, bits: int) -> mx.array:  # fmt: skip
    """x @ dequantize(weight)^T through MLX's precompiled dequantize and matmul."""
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    return x @ w.astype(x.dtype).T
