"""Which machine a kernel verdict or a tune curve holds for: what decides a
kernel's correctness and speed, never where it runs.

A key is a readable slug plus a short hash of the full description, e.g.
`nvidia-h200-sm_90-drv580.95.05-cuda13.0-mlx0.32.4-1f0c3a9b2e`. The
description names:
- the backend the default device runs (cuda, metal or cpu) and its device:
  MLX's `mx.device_info()` name and architecture (CUDA: "NVIDIA H200",
  sm_90; Metal: the GPU family), never its UUID, PCI slot or free memory;
- CUDA: the driver (/proc/driver/nvidia/version, else `nvidia-smi` with a
  short timeout), the CUDA libraries MLX loads (the pip `nvidia-*` packages'
  versions: runtime, NVRTC, which compiles the kernels, cuBLAS, cuDNN) and
  the toolkit under CUDA_HOME whose headers NVRTC reads;
- Metal: the macOS version (the Metal compiler comes with it);
- CPU: the BLAS MLX's matmuls run on (kernels/cpu_blas.py: OpenBLAS or the
  wheel's own), which changes what a verify costs;
- the host CPU's model (every launch costs host time: at small shapes it
  decides faster or slower) and the MLX version.
What cannot be read is `unknown`, never an error. The hostname is not in it:
two identical machines share their verdicts, and two that differ in any of
the above never do. The description is written beside the verdicts, so a
person can read why a key changed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import mlx.core as mx

from specgate.kernels import cpu_blas

UNKNOWN = "unknown"
COMMAND_TIMEOUT_S = 5.0
# The pip distributions whose libraries MLX's CUDA backend loads (mlx-cuda-12
# or -13 pulls them in): their versions are the CUDA runtime it runs on.
CUDA_LIBRARIES = ("cuda-runtime", "cuda-nvrtc", "cublas", "cudnn")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _backend() -> str:
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "gpu"


def _device_info() -> Mapping:
    try:
        return mx.device_info()
    except Exception:  # noqa: BLE001 - an MLX without it, or a device it cannot read
        return {}


def _packages() -> dict[str, str]:
    return {(d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()}


def cpu_model(read: Callable[[str], str | None] = _read,
              run: Callable[[list[str]], str | None] = _run) -> str:  # fmt: skip
    """The host CPU's model name."""
    if sys.platform == "darwin":
        name = run(["sysctl", "-n", "machdep.cpu.brand_string"])
    else:
        text = read("/proc/cpuinfo") or ""
        name = next((line.split(":", 1)[1] for line in text.splitlines()
                     if line.startswith("model name") and ":" in line), None)  # fmt: skip
    return " ".join((name or platform.processor() or UNKNOWN).split())


def nvidia_driver(read: Callable[[str], str | None] = _read,
                  run: Callable[[list[str]], str | None] = _run) -> str:  # fmt: skip
    """The NVIDIA kernel driver's version: /proc first, nvidia-smi if not there."""
    text = read("/proc/driver/nvidia/version") or ""
    if m := re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+(?:\.\d+)+)", text):
        return m.group(1)
    out = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    lines = (out or "").strip().splitlines()
    return lines[0].strip() if lines and lines[0].strip() else UNKNOWN


def cuda_versions(packages: Mapping[str, str], read: Callable[[str], str | None] = _read) -> str:
    """The CUDA libraries MLX loads (pip), and the toolkit NVRTC reads headers from."""
    libs = sorted(f"{name.removeprefix('nvidia-')} {version}" for name, version in packages.items()
                  if name.startswith("nvidia-")
                  and any(lib in name for lib in CUDA_LIBRARIES))  # fmt: skip
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    toolkit = UNKNOWN
    try:
        toolkit = json.loads(read(f"{home}/version.json") or "{}")["cuda"]["version"]
    except (ValueError, KeyError, TypeError):
        pass
    return ", ".join([*libs, f"toolkit {toolkit}"])


def describe(*, backend: str | None = None, device_info: Mapping | None = None,
             mlx_version: str | None = None, packages: Mapping[str, str] | None = None,
             read: Callable[[str], str | None] = _read,
             run: Callable[[list[str]], str | None] = _run,
             blas: str | None = None) -> dict[str, str]:  # fmt: skip
    """This machine as far as kernels care (see the module docstring); any
    source may be handed in instead of read here."""
    backend = backend or _backend()
    info = _device_info() if device_info is None else device_info
    mlx_version = mlx_version or mx.__version__
    packages = _packages() if packages is None else packages
    out = {"backend": backend,
           "device": str(info.get("device_name") or UNKNOWN),
           "architecture": str(info.get("architecture") or UNKNOWN)}  # fmt: skip
    if backend == "cuda":
        out["driver"] = nvidia_driver(read, run)
        out["cuda"] = cuda_versions(packages, read)
        mlx_cuda = sorted(f"{n} {v}" for n, v in packages.items() if n.startswith("mlx-cuda"))
        out["mlx_cuda"] = ", ".join(mlx_cuda) or UNKNOWN
    elif backend == "metal":
        out["os"] = f"macOS {platform.mac_ver()[0] or UNKNOWN}"
    elif backend == "cpu":
        # The BLAS MLX's CPU matmuls bind to (kernels/cpu_blas.py): OpenBLAS
        # made a verify of 9 demo rows cost 2.5 steps instead of 3.5, so a
        # CPU's tune curves are its own.
        out["blas"] = blas or cpu_blas.LIBRARY or "bundled"
    out["cpu"] = cpu_model(read, run)
    out["mlx"] = mlx_version
    return out


def _slug_part(text: str) -> str:
    return re.sub(r"[^a-z0-9_.]+", "-", text.lower()).strip("-.")


def key(description: Mapping[str, str]) -> str:
    """The directory name verdicts and tune curves are kept under."""
    digest = hashlib.sha256(json.dumps(dict(description), sort_keys=True).encode()).hexdigest()[:10]
    d = description
    parts = [d.get("device", UNKNOWN) if d.get("backend") != "cpu" else d.get("cpu", UNKNOWN),
             d.get("architecture", UNKNOWN) if d.get("backend") == "cuda" else ""]  # fmt: skip
    if d.get("backend") == "cuda":
        parts.append(f"drv{d.get('driver', UNKNOWN)}")
        # NVRTC's version (it compiles the kernels), else the toolkit's
        cuda = re.search(r"cuda-nvrtc\S* (\d+\.\d+)|toolkit (\d+\.\d+)", d.get("cuda", ""))
        parts.append(f"cuda{(cuda.group(1) or cuda.group(2)) if cuda else UNKNOWN}")
    elif d.get("backend") == "metal":
        parts.append(d.get("os", UNKNOWN))
    parts.append(f"mlx{d.get('mlx', UNKNOWN)}")
    slug = "-".join(p for p in map(_slug_part, parts) if p)[:80]
    return f"{d.get('backend', UNKNOWN)}-{slug}-{digest}"


@functools.cache
def this_machine() -> dict[str, str]:
    """This process's description, read once (nvidia-smi may run, bounded)."""
    return describe()


def this_key() -> str:
    return key(this_machine())
