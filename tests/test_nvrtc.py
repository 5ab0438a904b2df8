"""Our CUDA kernels compiled ahead into MLX's kernel cache (specgate/kernels/nvrtc.py), on the CPU.

NVRTC compiles for a GPU without one (NVIDIA's PyPI wheels, a dev
dependency), so a CPU shows all but MLX loading the result:
- module names use libstdc++'s std::hash exactly (checked against g++'s
  where g++ is here, and against values it printed);
- the text is MLX's build_kernel's, byte for byte, for a launch of each
  kind (the parameter list follows which shapes the source reads);
- our real kernels (one matrix, tensor cores, fused) compile from that
  text with the prelude in place of MLX's device header, to a cubin
  holding the kernel's lowered name, written where MLX looks, .ptx last;
- the builder's worker processes (kernels/prebuild.py, Job kind "ours")
  compile each module once into the shared cache, find a cache's entries
  without compiling, and report a launch NVRTC refuses without stopping
  the others;
- kernels/wiring.prove has exactly what it will launch compiled first.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from specgate.kernels import nvrtc, qmm, qmm_mma
from specgate.kernels.prebuild import Builder, Job

KNOWN = {b"": 0x553E93901E462A6E, b"a": 0x454DDEE488C1ED6B, b"abcdefgh": 0x783DB3E38DB898BB,
         b"hello world, specgate!": 0xA46FA991D75B5939}  # fmt: skip  (g++ 12, libstdc++)


def test_module_names_hash_as_libstdcxx_does(tmp_path):
    for data, want in KNOWN.items():
        assert nvrtc.std_hash(data) == want
    if shutil.which("g++") is None:
        return
    src = tmp_path / "h.cpp"
    src.write_text("#include <iostream>\n#include <iterator>\n#include <string>\nint main() {\n"
                   "  std::string s((std::istreambuf_iterator<char>(std::cin)), {});\n"
                   "  std::cout << std::hex << std::hash<std::string>{}(s);\n}\n")  # fmt: skip
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(src)], check=True, timeout=120)
    for n in (0, 7, 8, 9, 15, 16, 1000, 4097):
        data = bytes((i * 37 + n) % 256 for i in range(n))
        out = subprocess.run([str(tmp_path / "h")], input=data, capture_output=True, check=True, timeout=30)
        assert int(out.stdout, 16) == nvrtc.std_hash(data)


def test_the_text_is_mlx_s():
    launch = nvrtc.launch("k", "// h\n", "  y[0] = x[x_shape[0] - 1] + w_strides[0];\n",
                          [("x", mx.bfloat16, 2), ("w", mx.uint32, 2), ("s", mx.float32, 0)],
                          [("y", mx.bfloat16), ("z", mx.float32)],
                          [("T", mx.float16), ("M", 3), ("B", True)])  # fmt: skip
    assert launch.kernel_name == "custom_kernel_k_float16_t_3_t"
    assert launch.mlx_text() == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "// h\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k_float16_t_3_t(\n"
        "    const __nv_bfloat16* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const uint32_t* w,\n"
        "    const __grid_constant__ Strides w_strides,\n"
        "    const float* s,\n"
        "    __nv_bfloat16* y,\n"
        "    float* z) {\n"
        "  using T = __half;\n  constexpr int M = 3;\n  constexpr bool B = true;\n\n"
        "  y[0] = x[x_shape[0] - 1] + w_strides[0];\n"
        "\n}\n\n} // namespace mlx::core::cu\n")  # fmt: skip
    assert launch.module_name == f"custom_kernel_k_float16_t_3_t_{nvrtc.std_hash(launch.mlx_text().encode()):x}"


@pytest.fixture(scope="module")
def compiler():
    c = nvrtc.nvrtc()
    if c is None:
        pytest.skip(f"no NVRTC here ({nvrtc.unavailable()}): the dev dependencies install it on Linux x86-64")
    return c


LAUNCHES = [qmm.cuda_launch(4, 256, 512, mx.bfloat16, 4, 64),
            qmm_mma.cuda_launch(5, 256, 512, mx.float16, 4, 64),
            qmm_mma.cuda_launch(3, 256, (512, 128, 128), mx.bfloat16, 8, 32)]  # fmt: skip


def test_our_kernels_compile_into_mlx_s_cache(compiler, tmp_path):
    for launch in LAUNCHES:
        assert nvrtc.seed(compiler, tmp_path, launch, "sm_90")
        ptx = tmp_path / f"{launch.module_name}.ptx"
        code = ptx.read_bytes()
        name, lowered = (tmp_path / f"{launch.module_name}.txt").read_text().rstrip("\n").split("\t")
        assert name == f"mlx::core::cu::{launch.kernel_name}"
        assert code[:4] == b"\x7fELF" and lowered.encode() in code  # a cubin with that kernel in it
        assert not nvrtc.seed(compiler, tmp_path, launch, "sm_90")  # there already: not compiled again
    assert sorted(p.suffix for p in tmp_path.iterdir()) == sorted([".cu", ".ptx", ".txt"] * 3)  # no temporaries


# What nvrtc.PRELUDE stood for before: libcu++'s array and cooperative groups,
# as MLX's device header includes them.
LIBCUXX_PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#ifndef MAX_NDIM
#define MAX_NDIM 10
#endif
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}

#include <cooperative_groups.h>

"""


def sections(elf: bytes) -> dict[str, tuple[int, bytes]]:
    """An ELF64 file's sections by name: (size, bytes; none for NOBITS)."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    names = heads[names_at][4]

    def name(at: int) -> str:
        return elf[names + at : elf.index(b"\0", names + at)].decode()

    return {name(h[0]): (h[5], b"" if h[1] == 8 else elf[h[4] : h[4] + h[5]]) for h in heads}


def test_the_prelude_gives_the_code_libcuxx_would(compiler):
    """nvrtc.PRELUDE declares the signature's Shape and Strides without
    libcu++'s headers (their parsing was most of a compile): each kernel's
    machine code and parameter buffer come out as with them; only its
    mangled name differs, which MLX reads from the cache's .txt."""
    for launch in (LAUNCHES[0], LAUNCHES[2]):  # one matrix; tensor cores, fused (shapes of 3)
        name = f"mlx::core::cu::{launch.kernel_name}"
        text = launch.mlx_text()
        code, lowered = compiler.compile(text.replace(nvrtc.MLX_HEADER, nvrtc.PRELUDE, 1), "a.cu", [name],
                                         "sm_90")  # fmt: skip
        want, want_lowered = compiler.compile(text.replace(nvrtc.MLX_HEADER, LIBCUXX_PRELUDE, 1), "b.cu",
                                              [name], "sm_90")  # fmt: skip
        ours, libcuxx = sections(code), sections(want)
        assert "Dims" in lowered[name] and "array" in want_lowered[name]
        for kind in (".text.", ".nv.constant0."):  # the code; the parameter buffer (its size)
            assert ours[kind + lowered[name]] == libcuxx[kind + want_lowered[name]], kind


def _ours(launch) -> Job:
    return Job("qmm", "ours", (0,), launch, "sm_90")


def test_a_worker_compiling_only_ours_never_loads_mlx(compiler, tmp_path):
    """A worker loads MLX (and with it CUDA, a context on the GPU) at its
    first job MLX builds, not at its start: an urgent worker compiling only
    ours starts a second or so sooner on a fresh machine."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("reads the worker's /proc/<pid>/maps (Linux)")
    private = tmp_path / "private"
    private.mkdir()
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(private),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # fmt: skip
    worker = subprocess.Popen([sys.executable, "-m", "specgate.kernels.prebuild", str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip

    def ask(job: Job) -> tuple[dict, str]:
        worker.stdin.write(job.line() + "\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline()), Path(f"/proc/{worker.pid}/maps").read_text()

    try:
        answer, maps = ask(_ours(LAUNCHES[0]))
        assert answer["ok"] and answer["built"] == 1 and nvrtc.cached(tmp_path, LAUNCHES[0])
        assert "libmlx" not in maps
        answer, maps = ask(Job("qmm", "stock", (2, 256, 512, "float32", 4, 64)))  # MLX's own build
        assert answer["ok"] and "libmlx" in maps
    finally:
        worker.stdin.close()
        worker.wait(30)


def test_worker_processes_compile_each_once_and_report_a_refusal(compiler, tmp_path):
    broken = nvrtc.launch("broken", "", "  this is not C++;\n", [("x", mx.float16, 1)], [("y", mx.float16)], [])
    b = Builder(tmp_path, 2, idle_s=0.5, arch="sm_90")
    report = b.build([_ours(lu) for lu in (*LAUNCHES, broken, LAUNCHES[0])])
    assert (report.built, report.failed, report.modules) == (3, 1, 3)
    assert "custom_kernel_broken" in report.errors[0] and "error" in report.errors[0]
    for launch in LAUNCHES:
        assert nvrtc.cached(tmp_path, launch)
    again = Builder(tmp_path, 2, idle_s=0.5, arch="sm_90")  # another process: finds the cache's entries
    report = again.build([_ours(lu) for lu in LAUNCHES])
    assert (report.built, report.modules) == (3, 0)  # done, nothing compiled
    b.close()
    again.close()


def test_prove_compiles_what_the_wiring_will_launch_first(compiler, tmp_path):
    """wiring.prove hands the seeder the launch of every (kernel, shape,
    width) it is about to prove, and the probe at 2 rows, before proving;
    once recorded, only those recorded ok (none here: the kernel is wrong
    on purpose, failure injection), so a restart compiles nothing it would
    not launch."""
    import mlx.nn as nn

    from specgate.kernels import wiring
    from specgate.kernels.guard import Candidate, Guard

    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
    nn.quantize(model, group_size=64, bits=4)

    def wrong(x, wq, scales, biases, group_size, bits):
        return mx.zeros((*x.shape[:-1], wq.shape[0]), x.dtype)

    cand = Candidate("test_wrong", "v1", wrong, launch=qmm.cuda_launch)
    guard = Guard([cand], cache_dir=tmp_path / "verdicts", machine="test", reps=1, inner=1)
    (tmp_path / "ptx").mkdir()
    b = Builder(tmp_path / "ptx", 2, idle_s=0.5, arch="sm_90")
    wiring.prove(model, "auto", range(6, 8), guard=guard, builder=b)
    want = {qmm.cuda_launch(m, k, n, mx.float32, 4, 64).module_name
            for k, n in ((128, 256), (256, 128)) for m in (6, 7)}  # fmt: skip
    k, n, dtype, bits, gs = wiring.model_shapes(model)[0]
    want.add(qmm.cuda_launch(2, k, n, dtype, bits, gs).module_name)  # the probe, at the first shape
    assert {p.name.removesuffix(".ptx") for p in (tmp_path / "ptx").glob("*.ptx")} == want
    assert b.done and all(j.kernel in ("ours", "reference") for j in b.done)
    assert guard.verdicts() and not any(v.ok for v in guard.verdicts().values())

    b.close()
    (tmp_path / "ptx2").mkdir()
    again = Builder(tmp_path / "ptx2", 2, idle_s=0.5, arch="sm_90")  # a fresh kernel cache, verdicts kept
    wiring.prove(model, "auto", range(6, 8), guard=guard, builder=again)
    assert not list((tmp_path / "ptx2").glob("*.ptx"))  # nothing it would launch: nothing compiled
    again.close()
