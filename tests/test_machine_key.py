"""The machine key kernel verdicts and tune curves are kept under (kernels/machine.py).

It names what decides a kernel's correctness and speed (GPU, driver, CUDA,
CPU, MLX version), never the hostname; verdicts recorded under another key
are proved again, never trusted; a kernel's version is its source file's hash.
"""

from __future__ import annotations

import json
import platform
import shutil
import socket

import mlx.core as mx

from specgate.kernels import machine, qmm, qmm_mma, tune
from specgate.kernels.guard import Candidate, Guard, cuda_candidate, cuda_mma_candidate

H200 = {"device_name": "NVIDIA H200", "architecture": "sm_90", "uuid": "GPU-1",
        "pci_bus_id": "0000:19:00.0", "free_memory": 1, "total_memory": 150_000_000_000}  # fmt: skip
PACKAGES = {"nvidia-cuda-nvrtc-cu12": "12.9.86", "nvidia-cublas-cu12": "12.9.1.4",
            "mlx-cuda-12": "0.32.4", "numpy": "2.0"}  # fmt: skip
DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 2025\n"
CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"


def files(extra: dict | None = None):
    """A machine's files, as `read` sees them (None: not there)."""
    known = {"/proc/driver/nvidia/version": DRIVER, "/proc/cpuinfo": CPUINFO} | (extra or {})
    return lambda path: known.get(path)


def no_commands(cmd):
    return None


def cuda_machine(**kw) -> dict:
    args = dict(backend="cuda", device_info=H200, mlx_version="0.32.4", packages=PACKAGES,
                read=files(), run=no_commands) | kw  # fmt: skip
    return machine.describe(**args)


def test_the_key_is_stable_and_never_names_the_host(monkeypatch):
    here = machine.describe()
    assert machine.key(here) == machine.key(machine.describe())
    assert here["mlx"] == mx.__version__ and "unknown" not in here["backend"]
    monkeypatch.setattr(platform, "node", lambda: "another-host")
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
    assert machine.key(machine.describe()) == machine.key(here)
    assert tune.machine_id() == machine.key(machine.this_machine())


def test_the_key_changes_with_what_decides_a_verdict():
    base = cuda_machine()
    assert base["device"] == "NVIDIA H200" and base["architecture"] == "sm_90"
    assert base["driver"] == "580.95.05" and base["cpu"] == "AMD EPYC 9654 96-Core Processor"
    assert "cuda-nvrtc-cu12 12.9.86" in base["cuda"] and base["mlx_cuda"] == "mlx-cuda-12 0.32.4"
    key = machine.key(base)
    assert key.startswith("cuda-nvidia-h200-sm_90-drv580.95.05-cuda12.9-mlx0.32.4-")
    # the same machine elsewhere (another card's UUID and slot, memory in use): the same key
    same = cuda_machine(device_info=H200 | {"uuid": "GPU-2", "pci_bus_id": "0000:2a:00.0",
                                            "free_memory": 7})  # fmt: skip
    assert machine.key(same) == key
    others = [
        cuda_machine(mlx_version="0.33.0"),
        cuda_machine(device_info=H200 | {"device_name": "NVIDIA H100 80GB HBM3"}),
        cuda_machine(read=files({"/proc/driver/nvidia/version": DRIVER.replace("580.95.05", "575.57.08")})),
        cuda_machine(packages=PACKAGES | {"nvidia-cuda-nvrtc-cu12": "12.8.93"}),
        cuda_machine(read=files({"/proc/cpuinfo": CPUINFO.replace("9654 96", "7763 64")})),
        cuda_machine(read=files({"/usr/local/cuda/version.json": '{"cuda": {"version": "13.0.1"}}'})),
    ]
    keys = {machine.key(d) for d in others}
    assert key not in keys and len(keys) == len(others)


def test_a_cpus_key_names_the_blas_its_matmuls_run_on():
    """OpenBLAS or the mlx wheel's own (kernels/cpu_blas.py): other costs,
    other tune curves."""
    cpu = dict(backend="cpu", device_info={}, mlx_version="0.32.4", packages={}, read=files(),
               run=no_commands)  # fmt: skip
    openblas = machine.describe(**cpu, blas="libopenblas.so.0")
    assert openblas["blas"] == "libopenblas.so.0"
    assert machine.key(openblas) == machine.key(machine.describe(**cpu, blas="libopenblas.so.0"))
    assert machine.key(openblas) != machine.key(machine.describe(**cpu, blas="bundled"))
    assert "blas" not in cuda_machine()  # a GPU's verdicts are its kernels'


def test_what_cannot_be_read_is_unknown_and_nvidia_smi_is_the_fallback():
    bare = cuda_machine(read=lambda path: None, device_info={}, packages={})
    assert bare["driver"] == bare["device"] == bare["mlx_cuda"] == "unknown"
    assert bare["cuda"] == "toolkit unknown" and machine.key(bare).startswith("cuda-unknown-")
    smi = cuda_machine(read=lambda path: None,
                       run=lambda cmd: "580.82.07\n" if cmd[0] == "nvidia-smi" else None)  # fmt: skip
    assert smi["driver"] == "580.82.07"
    assert machine._run(["specgate-no-such-command"]) is None  # a missing tool: no exception
    mac = machine.describe(backend="metal", device_info={"device_name": "Apple M2 Ultra",
                                                         "architecture": "applegpu_g14d"},
                           read=lambda path: None, run=lambda cmd: None)  # fmt: skip
    assert mac["os"].startswith("macOS") and "driver" not in mac


def stock(x, wq, s, b, gs, bits):
    return qmm.reference_qmm(x, wq, s, b, gs, bits)


def guard_for(tmp_path, description) -> Guard:
    # margin inf: correct is enough (the stock op wrapped is not faster)
    return Guard([Candidate("stock", "1", stock)], cache_dir=tmp_path, description=description,
                 reps=1, inner=1, margin=float("inf"))  # fmt: skip


SHAPE = (2, 64, 32, mx.float32, 4, 64)


def test_verdicts_of_another_machine_are_proved_again(tmp_path):
    here, there = cuda_machine(), cuda_machine(mlx_version="0.33.0")
    first = guard_for(tmp_path, here)
    assert first.verdict(first.candidates[0], *SHAPE).ok and first.checks_run == 1
    saved = json.loads(first.path.read_text())
    assert saved["machine"] == machine.key(here) == first.path.parent.name
    assert saved["description"] == here  # why this key, for a person reading it

    again = guard_for(tmp_path, dict(here))  # another process on the same machine
    again.verdict(again.candidates[0], *SHAPE)
    assert again.checks_run == 0

    other = guard_for(tmp_path, there)  # the other machine's key: its own file, proved anew
    other.verdict(other.candidates[0], *SHAPE)
    assert other.path != first.path and other.checks_run == 1

    # A file copied under this machine's key from another's is not trusted.
    shutil.copy(first.path, other.path)
    copied = guard_for(tmp_path, there)
    copied.verdict(copied.candidates[0], *SHAPE)
    assert copied.checks_run == 1
    assert json.loads(copied.path.read_text())["machine"] == machine.key(there)


def test_a_kernels_version_is_its_source_files_hash(tmp_path):
    assert cuda_candidate().version == qmm.source_hash(qmm.__file__, "")
    assert cuda_mma_candidate().version == qmm.source_hash(qmm_mma.__file__, "")
    src = tmp_path / "kernel.py"
    src.write_text("W = 4  # warps\n")
    before = qmm.source_hash(str(src), "")
    src.write_text("W = 8  # warps\n")  # a launch setting, not the kernel text
    assert qmm.source_hash(str(src), "") != before
    assert qmm.source_hash(str(tmp_path / "gone.py"), "text") == qmm.source_hash(
        str(tmp_path / "also-gone.py"), "text")  # unreadable file: the kernel text's hash
