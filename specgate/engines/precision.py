"""Which float type a model computes in: float32 on a CPU with a real BLAS.

On MLX's CPU backend a float32 matmul goes to BLAS, and where that is
OpenBLAS (kernels/cpu_blas.py) it ran 25-50x faster than the bfloat16 and
float16 ones, which MLX loops over itself. The demo model then prefilled
2.6x and decoded 1.6x as fast as mlx-lm's own load of it (bench/cpu_blas.py)
and a coding agent's first turn took 42 s instead of 174. So a model stored in half precision is cast to
float32 when it loads on such a CPU, up to HALF_LIMIT_BYTES of half weights
(the cast doubles them). A quantized model is left as it is: its matmuls
are MLX's own quantized kernels, which a cast does not speed up. On a GPU
nothing changes.

Every part of one model computes in one type: its drafters and heads
follow the target (`follow`), its prefix cache's files on disk are named
with the type (engines/loading.py), as its states differ, and the memory
budget counts the cast bytes before the load (`upcast_applies`).
"""

from __future__ import annotations

import logging
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from specgate.kernels import cpu_blas

log = logging.getLogger(__name__)

HALF_LIMIT_BYTES = 2 << 30  # ~1B parameters: 4 GiB once in float32
_HALF = (mx.bfloat16, mx.float16)
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def _castable(half_bytes: int, quantized: bool, limit: int) -> bool:
    """A model the cast would speed up on MLX's CPU backend, given a BLAS."""
    return mx.default_device() == mx.cpu and not quantized and 0 < half_bytes <= limit


def upcast_applies(half_bytes: int, quantized: bool, limit: int = HALF_LIMIT_BYTES) -> bool:
    """The rule, for a model of `half_bytes` of half-precision weights: also
    what the memory budget reads before a load (gateway/serving/footprint.py)."""
    return cpu_blas.LIBRARY is not None and _castable(half_bytes, quantized, limit)


def upcast_on_cpu(module: nn.Module, name: str = "", limit: int = HALF_LIMIT_BYTES) -> bool:
    """Cast `module`'s half-precision weights to float32 where that is the
    faster way to compute it (see the module docstring); whether it did."""
    quantized = any(isinstance(m, _QUANTIZED) for _, m in module.named_modules())
    half = sum(v.nbytes for _, v in tree_flatten(module.parameters()) if v.dtype in _HALF)
    name = name or type(module).__name__
    if upcast_applies(half, quantized, limit):
        cast(module)
        log.info("%s: computing in float32 on the CPU (%s), %.0f MB of half-precision weights "
                 "cast", name, cpu_blas.LIBRARY, half / 1e6)  # fmt: skip
        return True
    if (cpu_blas.LIBRARY is None and _castable(half, quantized, limit) and sys.platform == "linux"
            and os.environ.get("SPECGATE_SYSTEM_BLAS") != "0"):  # fmt: skip
        log.info("%s: computing in half precision on MLX's own CPU loops; with OpenBLAS "
                 "installed (Debian: libopenblas0) it would compute in float32 through it, "
                 "2-3x faster (kernels/cpu_blas.py)", name)  # fmt: skip
    return False


def follow(module: nn.Module, upcast: bool) -> None:
    """A drafter or head computes in its target's type: float32 if the
    target was cast (`upcast`), as stored otherwise."""
    if upcast and not any(isinstance(m, _QUANTIZED) for _, m in module.named_modules()):
        cast(module)


def cast(module: nn.Module) -> None:
    module.set_dtype(mx.float32, lambda t: t in _HALF)
    mx.eval(module.parameters())
