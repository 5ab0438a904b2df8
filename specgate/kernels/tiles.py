"""While MLX builds its quantized matmul's tile for a row range, a forward
computes that product as dequantize + matmul instead of waiting.

Why: on CUDA, MLX's quantized matmul from TILE_ROWS rows up is a CUTLASS
template per row range and precision, built with NVRTC at its first call
(~27 s each on an H100), so a fresh machine's first prompt waited ~50 s
for one (kernels/README.md). kernels/prebuild.py builds those tiles in
worker processes meanwhile; until the one a call needs is built there,
`mx.dequantize` and a matmul (both precompiled in MLX: no build) give the
same product, rounded once more (the weights to the activations' dtype, as
a bf16 / f16 model's own weights are), at about twice the tile's cost on
a long prompt. Nothing here runs on Metal or a CPU: only where a builder
exists (engines/kernel_wiring.prebuild_forward).
"""

from __future__ import annotations

import threading

import mlx.core as mx

from specgate.kernels.guard import dtype_name

# MLX's quantized matmul on CUDA below this many rows is its precompiled
# matrix-vector kernel; from it on, a CUTLASS tile built at first use.
TILE_ROWS = 8


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

    def __init__(self, built, finished: threading.Event):
        self._built = built  # () -> set of (op, rows, dtype name, bits, group size)
        self._finished = finished
        self._ready: set[tuple] = set()

    def ready(self, rows: int, dtype: mx.Dtype, bits: int, group_size: int) -> bool:
        key = (row_range(rows), dtype_name(dtype), bits, group_size)
        if key in self._ready or self._finished.is_set():
            return True
        if any((row_range(g[1]), *g[2:]) == key for g in self._built()):
            self._ready.add(key)
            return True
        return False


def dequantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                       group_size: int, bits: int) -> mx.array:  # fmt: skip
    """x @ dequantize(weight)^T through MLX's precompiled dequantize and matmul."""
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    return x @ w.astype(x.dtype).T
