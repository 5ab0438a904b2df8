"""MLX's CPU matmuls through OpenBLAS, and small half-precision models computed
in float32 there (kernels/cpu_blas.py, engines/precision.py).

Which library MLX's `cblas_sgemm` binds to is read from the dynamic linker
itself (LD_DEBUG=bindings), not from a timing. CI installs Debian's
libopenblas0 (.ci/run); a machine without it skips the binding tests.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import REPO

from specgate.engines import precision
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.engines.loading import _prefix_cache, load_mlx_model
from specgate.kernels import cpu_blas

_MATMUL = "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"
_SGEMM = re.compile(
    r"binding file \S*libmlx\.so \[\d+\] to (\S+) \[\d+\]: normal symbol `cblas_sgemm'"
)


def _has_openblas() -> bool:
    try:
        ctypes.CDLL("libopenblas.so.0")
    except OSError:
        return False
    return True


needs_openblas = pytest.mark.skipif(sys.platform != "linux" or not _has_openblas(),
                                    reason="no libopenblas.so.0 (Debian's libopenblas0)")  # fmt: skip


def _sgemm_library(code: str, **env: str) -> str:
    """The file MLX's cblas_sgemm bound to in a fresh interpreter running `code`."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=os.environ | {"LD_DEBUG": "bindings"} | env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = _SGEMM.findall(done.stderr)
    assert found, "libmlx.so bound no cblas_sgemm (LD_DEBUG printed none)"
    return found[-1]


@needs_openblas
def test_importing_specgate_first_binds_mlx_to_openblas():
    bound = _sgemm_library(f"import specgate, mlx.core as mx; {_MATMUL}")
    assert "openblas" in bound, bound


@needs_openblas
def test_it_is_off_when_turned_off_or_when_mlx_came_first():
    """The wheel's own BLAS where the user turned it off, or where MLX was
    already loaded (libmlx's symbols are bound then: nothing is patched)."""
    off = _sgemm_library(f"import specgate, mlx.core as mx; {_MATMUL}", SPECGATE_SYSTEM_BLAS="0")
    assert "openblas" not in off and "mlx" in off, off
    code = ("import mlx.core as mx, specgate\nfrom specgate.kernels import cpu_blas\n"
            f"assert cpu_blas.LIBRARY is None\n{_MATMUL}")  # fmt: skip
    late = _sgemm_library(code)
    assert "openblas" not in late, late


def _mlp(dtype) -> nn.Module:
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    m.set_dtype(dtype)
    return m


def _dtypes(module: nn.Module) -> set:
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(module.parameters())}


def test_the_upcast_rule(monkeypatch):
    """float32 for a half model on a CPU with OpenBLAS, within the limit;
    as stored otherwise: no OpenBLAS, a quantized model, over the limit."""
    monkeypatch.setattr(cpu_blas, "LIBRARY", "libopenblas.so.0")  # as bound (the rule alone)
    assert mx.default_device() == mx.cpu  # this machine: MLX on its CPU
    m = _mlp(mx.bfloat16)
    assert precision.upcast_on_cpu(m) and _dtypes(m) == {mx.float32}
    assert not precision.upcast_on_cpu(_mlp(mx.float32))  # nothing half to cast
    big = _mlp(mx.float16)
    assert not precision.upcast_on_cpu(big, limit=100) and _dtypes(big) == {mx.float16}
    q = _mlp(mx.bfloat16)
    nn.quantize(q, group_size=32, bits=4)
    assert not precision.upcast_on_cpu(q) and mx.bfloat16 in _dtypes(q)
    monkeypatch.setattr(cpu_blas, "LIBRARY", None)
    assert not precision.upcast_on_cpu(_mlp(mx.bfloat16))


@needs_openblas
def test_the_demo_computes_in_float32_with_its_head_and_cache_files_of_its_own(tmp_path,
                                                                                monkeypatch):  # fmt: skip
    """The served demo (bfloat16 on disk) in float32, its MTP head too, and
    its prefix cache's disk files named apart from a bfloat16 load's."""
    if cpu_blas.LIBRARY is None:
        pytest.skip("this test process imported MLX before specgate")
    from specgate.engines.base import CacheSettings
    from specgate.engines.drafting.mtp.loading import load_mtp_head

    loaded = load_mlx_model(str(default_model_path()))
    assert loaded.upcast and _dtypes(loaded.model) <= {mx.float32, mx.uint32}
    assert _dtypes(load_mtp_head(loaded)) == {mx.float32}

    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    settings = CacheSettings(disk_bytes=1 << 20)
    names = {up: _prefix_cache(loaded.path, loaded.model, settings, upcast=up).disk.digest
             for up in (False, True)}  # fmt: skip
    assert names[False] != names[True]


@needs_openblas
def test_openblas_computes_on_the_callers_thread_unless_told_otherwise():
    code = ("import ctypes, specgate\n"
            "print(ctypes.CDLL('libopenblas.so.0').openblas_get_num_threads())")  # fmt: skip
    bare = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    }

    def threads(**env: str) -> int:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, env=bare | env, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout)

    assert threads() == 1
    assert threads(OPENBLAS_NUM_THREADS="2") == 2


def test_the_memory_budget_counts_what_the_cast_holds():
    """The estimate before a load (gateway/serving/footprint.py) follows the
    same rule: the demo's bfloat16 weights and KV count twice where it
    computes in float32, and the estimate then matches the load."""
    from specgate.engines.checkpoints.inspect import inspect_checkpoint
    from specgate.engines.memory import parameter_bytes
    from specgate.gateway.config import ModelConfig
    from specgate.gateway.serving.footprint import estimate

    if cpu_blas.LIBRARY is None:
        pytest.skip("no OpenBLAS bound in this test process")
    demo = ModelConfig(id="d", path="builtin:demo", max_context=1024)
    est = estimate(demo)
    loaded = load_mlx_model(str(default_model_path()))
    # The MTP head is counted in the target's weights and loaded apart.
    head = inspect_checkpoint(str(default_model_path())).memory.mtp_head_bytes
    assert abs(est.weights - (parameter_bytes(loaded.model) + 2 * head)) < 1 << 16
    assert any("float32" in n for n in est.notes)
