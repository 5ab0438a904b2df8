"""Our CUDA kernels compiled with NVRTC ahead of MLX, and handed to it
through its kernel cache, so that MLX never builds them.

Why: MLX builds a custom kernel (mx.fast.cuda_kernel) with NVRTC at its
first launch, one kernel at a time per process, and never writes it to
its disk cache (use_disk_cache is false for them), so a fresh H100 spent
~40 s building a speculative engine's lone verify widths one by one, and
every restart spent it again. But MLX looks every module up in
MLX_PTX_CACHE_DIR before building it (mlx/backend/cuda/jit_module.cpp:
read_cached_ptx; <module>.ptx holds the cubin, <module>.txt the kernel's
name and its lowered symbol). So `seed` writes the entry MLX would look
for:
- the text MLX generates for the launch (mlx/backend/cuda/custom_kernel.cpp,
  build_kernel: `mlx_text`) names the module: "custom_kernel_<name><template
  hash>_<std::hash of the text, hex>" (`module_name`);
- NVRTC compiles that text, with MLX's device header (not shipped in its
  wheel) replaced by what the text uses of it (PRELUDE: the Shape and
  Strides parameter types), with MLX's options;
- the cubin and the lowered name land in the cache, the .ptx last.

NVRTC compiles one program at a time in a process (on an H100, 24 of our
kernels took 50 s on 8 threads: 2.1 s each, one after the other), and
meanwhile every build MLX needs in that process waits too, so the
compiles run in kernels/prebuild.py's worker processes (Job kind "ours"),
each writing into the shared cache. The entries outlive the process: a
restart builds nothing. If a future MLX generates other text, the name
misses and MLX builds the kernel itself, as before: slower, never wrong
(kernels/guard.py proves whatever runs).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

# ---------------------------------------------------------------- MLX's text

# custom_kernel.cpp's default_header, and what this module compiles instead
# of the header it includes (MLX's wheel does not ship it: MLX hands NVRTC
# its device headers from memory). Only the parameter types the generated
# signature uses; our kernels use nothing else of it. Their size is MLX's
# MAX_NDIM, read from the config.h its wheel does ship (the text does not
# name it: a mismatch would pass arguments the kernel reads wrong).
# Not libcu++'s <cuda/std/array> nor <cooperative_groups.h>: parsing the two
# was ~85 % of a compile (~3.5 s of ~4 on this project's 2-core CI machine,
# against ~0.5 s without). A struct of one array member has cuda::std::array's
# layout, and the text only aliases the cooperative_groups namespace (`cg`),
# which our kernels never use: a kernel's machine code and parameter table
# come out byte for byte the same (tests/test_nvrtc.py), only its mangled
# name differs, which MLX reads from the cache's .txt. A kernel of ours that
# used cooperative groups would fail here, and MLX would build it: slower,
# never wrong.
MLX_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
#if __has_include("mlx/backend/cuda/device/config.h")
#include "mlx/backend/cuda/device/config.h"
#endif
#ifndef MAX_NDIM
#define MAX_NDIM 10
#endif
namespace mlx::core::cu {
template <typename T, int N>
struct Dims {
  T elems[N];
  __device__ const T& operator[](int i) const { return elems[i]; }
};
using Shape = Dims<int32_t, MAX_NDIM>;
using Strides = Dims<int64_t, MAX_NDIM>;
}

namespace cooperative_groups {}

"""

# mlx/backend/cuda/utils.cpp dtype_to_cuda_type; backend/common/compiled.cpp get_type_string
_CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "uint32_t",
               "int32": "int32_t", "uint8": "uint8_t", "bool": "bool"}  # fmt: skip
_TYPE_STRINGS = {"float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float", "uint32": "uint32_t",
                 "int32": "int32_t", "uint8": "uint8_t", "bool": "bool"}  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """One mx.fast.cuda_kernel launch as MLX names and writes it: the
    kernel object's name, header and source, its inputs (name, dtype name,
    ndim) and outputs (name, dtype name), and the launch's template
    arguments (name, int or dtype name: "T", "bfloat16")."""

    name: str
    header: str
    source: str
    inputs: tuple[tuple[str, str, int], ...]
    outputs: tuple[tuple[str, str], ...]
    template: tuple[tuple[str, int | str], ...]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Launch:
        """The Launch `to_dict` gave (JSON's lists back to tuples)."""
        return cls(d["name"], d["header"], d["source"], tuple(tuple(i) for i in d["inputs"]),
                   tuple(tuple(o) for o in d["outputs"]), tuple(tuple(t) for t in d["template"]))  # fmt: skip

    @property
    def kernel_name(self) -> str:
        """custom_kernel.cpp: "custom_kernel_" + name + template_arguments_hash."""
        parts = []
        for _, value in self.template:
            if isinstance(value, bool):
                parts.append("_t" if value else "_f")
            elif isinstance(value, int):
                parts.append(f"_{value}")
            else:
                parts.append("_" + _TYPE_STRINGS[value])
        return f"custom_kernel_{self.name}{''.join(parts)}"

    def mlx_text(self) -> str:
        """The source MLX generates for this launch (build_kernel)."""
        out = [MLX_HEADER, self.header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
               f"__global__ void {self.kernel_name}(\n"]  # fmt: skip
        for name, dtype, ndim in self.inputs:
            out.append(f"    const {_CUDA_TYPES[dtype]}* {name},\n")
            if ndim > 0:
                if name + "_shape" in self.source:
                    out.append(f"    const __grid_constant__ Shape {name}_shape,\n")
                if name + "_strides" in self.source:
                    out.append(f"    const __grid_constant__ Strides {name}_strides,\n")
                if name + "_ndim" in self.source:
                    out.append(f"    const __grid_constant__ int {name}_ndim,\n")
        for i, (name, dtype) in enumerate(self.outputs):
            out.append(f"    {_CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(self.outputs) - 1 else ") {\n"))
        if self.template:
            for name, value in self.template:
                if isinstance(value, bool):
                    out.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
                elif isinstance(value, int):
                    out.append(f"  constexpr int {name} = {value};\n")
                else:
                    out.append(f"  using {name} = {_CUDA_TYPES[value]};\n")
            out.append("\n")
        out.append(self.source)
        out.append("\n}\n\n} // namespace mlx::core::cu\n")
        return "".join(out)

    @functools.cached_property
    def module_name(self) -> str:
        """custom_kernel.cpp: "{kernel name}_{std::hash of the text:x}"."""
        return f"{self.kernel_name}_{std_hash(self.mlx_text().encode()):x}"


def _dtype(value) -> str:
    return str(value).rsplit(".", 1)[-1]  # mx.float16 -> "float16"


def launch(name: str, header: str, source: str, inputs, outputs, template) -> Launch:
    """A Launch from what mx.fast.cuda_kernel is given: inputs as (name,
    dtype, ndim), outputs as (name, dtype), template arguments as (name,
    int or dtype), dtypes as MLX's."""
    def value(v):
        return v if isinstance(v, int) else _dtype(v)

    return Launch(name, header, source, tuple((n, _dtype(d), nd) for n, d, nd in inputs),
                  tuple((n, _dtype(d)) for n, d in outputs), tuple((n, value(v)) for n, v in template))  # fmt: skip


_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s std::hash<std::string> (std::_Hash_bytes, the 64-bit
    MurmurHash2 variant of libsupc++/hash_bytes.cc), which MLX's module
    names use."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * _MUL)) & _M64
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i : i + 8], "little")
        h ^= (shift_mix((word * _MUL) & _M64) * _MUL) & _M64
        h = (h * _MUL) & _M64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _M64
    h = (shift_mix(h) * _MUL) & _M64
    return shift_mix(h)


# ---------------------------------------------------------------- NVRTC


class NvrtcError(RuntimeError):
    pass


class Nvrtc:
    """libnvrtc through ctypes: `compile` turns a CUDA source into a cubin
    (or PTX where this NVRTC cannot emit the device's code) and the lowered
    names of the kernels asked for. Thread-safe: one program per call."""

    def __init__(self, lib: ctypes.CDLL, include_paths: list[str]):
        self.lib = lib
        self.include_paths = include_paths
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, what: str, prog=None) -> None:
        if result != 0:
            log = self._log(prog) if prog is not None else ""
            raise NvrtcError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}{log}")

    def _log(self, prog) -> str:
        size = ctypes.c_size_t()
        if self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
            return ""
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return "\n" + buf.value.decode(errors="replace")[-2000:]

    def compile(self, source: str, name: str, expressions: list[str], arch: str) -> tuple[bytes, dict]:
        """(code, {expression: lowered name}); `arch` as in device_info
        ("sm_90"). Options as MLX's (jit_module.cpp: compile): the device's
        code (a cubin), else PTX where this NVRTC is older than the device
        (the driver finishes it)."""
        cc = int(arch.removeprefix("sm_"))
        suffix = "a" if cc >= 90 else ""
        try:
            return self._compile(source, name, expressions, f"sm_{cc}{suffix}", cubin=True)
        except NvrtcError:
            return self._compile(source, name, expressions, f"compute_{cc}{suffix}", cubin=False)

    def _compile(self, source: str, name: str, expressions: list[str], target: str,
                 cubin: bool) -> tuple[bytes, dict]:  # fmt: skip
        lib, c = self.lib, ctypes
        prog = c.c_void_p()
        self._check(lib.nvrtcCreateProgram(c.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")  # fmt: skip
        try:
            for e in expressions:
                self._check(lib.nvrtcAddNameExpression(prog, e.encode()), "nvrtcAddNameExpression", prog)
            opts = [b"--device-as-default-execution-space", f"--gpu-architecture={target}".encode(),
                    *(f"--include-path={p}".encode() for p in self.include_paths)]  # fmt: skip
            arr = (c.c_char_p * len(opts))(*opts)
            self._check(lib.nvrtcCompileProgram(prog, len(opts), arr), "nvrtcCompileProgram", prog)
            lowered = {}
            for e in expressions:
                out = c.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, e.encode(), c.byref(out)), "nvrtcGetLoweredName", prog)
                lowered[e] = out.value.decode()
            size = c.c_size_t()
            get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else \
                (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)  # fmt: skip
            self._check(get_size(prog, c.byref(size)), "code size", prog)
            buf = c.create_string_buffer(size.value)
            self._check(get(prog, buf), "code", prog)
            return buf.raw, lowered
        finally:
            lib.nvrtcDestroyProgram(c.byref(prog))


def site_dirs() -> list[Path]:
    """Where Python packages are installed (NVIDIA's wheels put CUDA's
    libraries and headers under <site>/nvidia/)."""
    return [Path(p) for p in dict.fromkeys(sys.path) if p and Path(p, "nvidia").is_dir()]


def find_library() -> ctypes.CDLL | None:
    """libnvrtc: the one MLX loaded (its soname), else one in NVIDIA's wheels."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for site in site_dirs():
        names += sorted(glob.glob(str(site / "nvidia" / "*" / "lib" / "libnvrtc.so*")), reverse=True)
    for name in names:
        if "builtins" in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def include_paths(mlx_dir: Path) -> list[str]:
    """MLX's own (jit_module.cpp: include_path_args): its bundled headers and
    CCCL, then CUDA's from NVIDIA's wheels, CUDA_HOME or /usr/local/cuda."""
    out = [mlx_dir / "include", mlx_dir / "include" / "cccl"]
    for site in site_dirs():
        out += [site / "nvidia" / "cu13" / "include", site / "nvidia" / "cu13" / "include" / "cccl",
                site / "nvidia" / "cuda_runtime" / "include", site / "nvidia" / "cuda_cccl" / "include"]  # fmt: skip
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    out += [Path(home) / "include", Path(home) / "include" / "cccl"]
    return [str(p) for p in dict.fromkeys(out) if p.is_dir()]


_nvrtc: Nvrtc | None = None
_nvrtc_error: str | None = None
_lock = threading.Lock()


def nvrtc() -> Nvrtc | None:
    """This process's NVRTC (None, with `unavailable()` saying why, where it
    cannot be loaded)."""
    global _nvrtc, _nvrtc_error
    with _lock:
        if _nvrtc is None and _nvrtc_error is None:
            import mlx

            lib = find_library()
            if lib is None:
                _nvrtc_error = "no libnvrtc found"
            else:
                try:
                    _nvrtc = Nvrtc(lib, include_paths(Path(mlx.__path__[0])))
                except (NvrtcError, AttributeError, OSError) as e:
                    _nvrtc_error = f"{type(e).__name__}: {e}"
        return _nvrtc


def unavailable() -> str | None:
    return _nvrtc_error


# ---------------------------------------------------------------- MLX's cache


def cached(cache_dir: Path, launch: Launch) -> bool:
    return _ptx_path(cache_dir, launch.module_name).exists()


def _ptx_path(cache_dir: Path, module: str) -> Path:
    """jit_module.cpp get_ptx_path: names past 245 characters become folders."""
    limit, path = 245, Path(cache_dir)
    while len(module) > limit:
        path, module = path / module[:limit], module[limit:]
    return path / f"{module}.ptx"


def seed(compiler: Nvrtc, cache_dir: Path, launch: Launch, arch: str) -> bool:
    """Compile `launch` and write it where MLX will look for it; False where
    it was there already. Raises NvrtcError where NVRTC refuses it."""
    module = launch.module_name
    ptx = _ptx_path(cache_dir, module)
    if ptx.exists():
        return False
    text = launch.mlx_text()
    ours = text.replace(MLX_HEADER, PRELUDE, 1)
    name = f"mlx::core::cu::{launch.kernel_name}"
    code, lowered = compiler.compile(ours, module + ".cu", [name], arch)
    ptx.parent.mkdir(parents=True, exist_ok=True)
    tmp = f".{os.getpid()}-{threading.get_ident()}.tmp"
    txt = ptx.with_suffix(".txt")
    Path(str(txt) + tmp).write_text(f"{name}\t{lowered[name]}\n")
    Path(str(ptx) + tmp).write_bytes(code)
    Path(str(ptx.with_suffix(".cu")) + tmp).write_text(ours)
    os.replace(str(txt) + tmp, txt)
    os.replace(str(ptx.with_suffix(".cu")) + tmp, ptx.with_suffix(".cu"))
    os.replace(str(ptx) + tmp, ptx)  # last: MLX takes a module to be there once its .ptx is
    return True

