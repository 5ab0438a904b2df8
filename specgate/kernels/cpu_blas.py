"""MLX's CPU matmuls through the machine's OpenBLAS, where it has one.

The Linux `mlx[cpu]` wheel links netlib's reference BLAS
(`mlx_cpu.libs/libblas-*.so`): a float32 (2048 x 256) @ (256 x 512) ran at
~4 GFLOP/s on this project's 2-core x86 machine, 50x slower than OpenBLAS
on the same cores (0.12 s against 2.5 ms). MLX computes bfloat16 and
float16 matmuls on the CPU with a loop of its own, hardly faster (~7
GFLOP/s). So on a Linux CPU the demo model prefilled 230 tokens/s, and a
coding agent's 20k-token first turn took three minutes.

Loading OpenBLAS with RTLD_GLOBAL before `mlx.core` is imported puts its
`cblas_*` symbols in the process's global scope, which the dynamic linker
searches before libmlx.so's own dependencies, so libmlx binds to it (as
LD_PRELOAD would, without re-executing the process). Nothing of MLX is
patched, and only where MLX is not yet loaded: `import specgate` does it
first thing (specgate/__init__.py). engines/precision.py then computes
small half-precision models in float32 on the CPU, where this BLAS runs.

macOS is left alone (MLX uses Accelerate there). SPECGATE_SYSTEM_BLAS=0
turns it off. OpenBLAS computes on the calling thread only, unless
OPENBLAS_NUM_THREADS (or OMP_NUM_THREADS) says otherwise: the engines'
threads, the tokenizers' pool and other models' engines already share the
cores, and OpenBLAS's idle workers spin before they sleep. The test suite
(three workers, their gateways and ranks on two cores) took 933 s with a
thread per core, against 548 s with one.
"""

from __future__ import annotations

import ctypes
import os
import sys

# The library bound, None where none was (not Linux, MLX already loaded,
# none installed, or turned off).
LIBRARY: str | None = None
_CANDIDATES = ("libopenblas.so.0", "libopenblas.so")  # Debian's libopenblas0 gives the first


def bind() -> str | None:
    """Load OpenBLAS for MLX's CPU backend if this process can still use it
    (see the module docstring); the library's name, or None."""
    global LIBRARY
    if LIBRARY is not None:
        return LIBRARY
    if (sys.platform != "linux" or "mlx.core" in sys.modules
            or os.environ.get("SPECGATE_SYSTEM_BLAS", "1") == "0"):  # fmt: skip
        return None
    for name in _CANDIDATES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError:
            continue
        told = {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"} & os.environ.keys()
        set_threads = getattr(lib, "openblas_set_num_threads", None)  # in every OpenBLAS we know
        if set_threads is not None and not told:
            set_threads(1)
        LIBRARY = name
        return name
    return None
