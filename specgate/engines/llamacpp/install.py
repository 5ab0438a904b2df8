"""`specgate install-llama-server`: build llama-server from the pinned llama.cpp sources.

PyPI has no wheel that ships llama-server, so we build it from the llama.cpp
tree vendored in the pinned llama-cpp-python sdist (a source we already trust
and pin), once per machine, into SPECGATE_HOME.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from specgate.engines.home import llama_cpp_dir, logs_dir
from specgate.engines.llamacpp.binary import (
    LLAMA_CPP_TAG,
    installed_llama_server_path,
    llama_server_version,
)
from specgate.engines.progress import bar, say

PINNED = "0.3.36"  # llama-cpp-python; vendors llama.cpp LLAMA_CPP_TAG (b11312)
SDIST_NAME = f"llama_cpp_python-{PINNED}.tar.gz"
# sha256 of that sdist as PyPI served it (two independent downloads agreed), so a
# swapped or corrupted file is refused before we compile and run anything from it.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = "vendor/llama.cpp/"
# make's `[ 45%] Building ...` and ninja's `[12/206] Building ...`
BUILD_PROGRESS = re.compile(r"\[\s*(\d+)%\]|\[(\d+)/(\d+)\]")
PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")  # pip's --progress-bar raw
FAILED_TAIL_LINES = 20

Progress = Callable[[str], None]


class InstallError(RuntimeError):
    """Building or installing llama-server failed; the message says why and what to do."""


def _install_advice() -> str:
    if sys.platform == "darwin":
        return "install them with `xcode-select --install` and `brew install cmake`"
    return "on Debian/Ubuntu install them with `apt-get install cmake build-essential`"


def check_prerequisites() -> dict[str, str]:
    """The build tools found, by role; raises InstallError naming every missing one."""
    wanted = {
        "cmake": ["cmake"],
        "C++ compiler": ["c++", "g++", "clang++"],
        "make or ninja": ["ninja", "make"],
    }
    found: dict[str, str] = {}
    missing: list[str] = []
    for role, names in wanted.items():
        hit = next((shutil.which(n) for n in names if shutil.which(n)), None)
        if hit:
            found[role] = hit
        else:
            missing.append(f"{role} ({' / '.join(names)})")
    if missing:
        raise InstallError(
            f"building llama-server needs {', '.join(missing)}, not found on PATH; {_install_advice()}"
        )
    return found


def cmake_flags() -> list[str]:
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",  # specgate hands llama-server local files only
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",  # the server lives under tools/
        "-DLLAMA_BUILD_SERVER=ON",
        "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary, no RPATH into the build tree
        # Tuned for this machine's CPU (-march=native): the binary is built where it
        # runs and is not meant to be copied to another machine.
        "-DGGML_NATIVE=ON",
    ]
    if sys.platform == "darwin":
        flags.append("-DGGML_METAL=ON")  # the default there; said explicitly
    return flags


def _pip_command() -> list[str]:
    """This interpreter's pip: a dependency of specgate, so `uv run` venvs have it too
    (a pip found on PATH may belong to another interpreter, or be the venv's pip-less one)."""
    if importlib.util.find_spec("pip") is None:
        raise InstallError(
            f"downloading the llama-cpp-python sources needs pip in {sys.executable}'s "
            "environment; reinstall specgate (pip is one of its dependencies)"
        )
    return [sys.executable, "-m", "pip"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(sdist: Path) -> Path:
    actual = _sha256(sdist)
    if actual != SDIST_SHA256:
        sdist.unlink()
        raise InstallError(
            f"{sdist.name} has sha256 {actual}, expected {SDIST_SHA256}; deleted it, retry"
        )
    return sdist


def download_sdist(dest: Path, log, progress: Progress) -> Path:
    sdist = dest / SDIST_NAME
    if sdist.is_file():
        progress(f"using the downloaded sources {sdist}")
        return _verified(sdist)
    progress(f"downloading llama-cpp-python {PINNED} sources (~77 MB) into {dest}")
    return _verified(pip_download(f"llama-cpp-python=={PINNED}", SDIST_NAME, dest, log, progress))


def pip_download(requirement: str, filename: str, dest: Path, log, progress: Progress) -> Path:
    """`pip download` one sdist into `dest` (the user's index and proxy settings apply),
    its bytes on a "download" bar, the rest of pip's output into `log`."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [*_pip_command(), "download", "--no-deps", "--no-binary", ":all:",
           "--progress-bar", "raw", requirement, "-d", str(dest)]  # fmt: skip
    log.write(f"$ {' '.join(cmd)}\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    tail: deque[str] = deque(maxlen=FAILED_TAIL_LINES)  # for the error
    with bar("download", unit="B", unit_scale=True) as shown:
        for line in proc.stdout:
            m = PIP_PROGRESS.fullmatch(line.strip())
            if not m:
                log.write(line)
                tail.append(line)
                continue
            done, total = int(m[1]), int(m[2])
            if total and shown.total != total:
                shown.total = total
                shown.refresh()  # the stage's start, now with its size
            shown.update(done - shown.n)
            if total and done >= total:
                break
    # pip then checks the package: it prepares its metadata, which installs
    # its build requirements into a temporary environment.
    if proc.poll() is None:
        progress("download: pip checks the package")
    for line in proc.stdout:
        log.write(line)
        tail.append(line)
    path = dest / filename
    if proc.wait() != 0 or not path.is_file():
        log.flush()
        raise InstallError(f"downloading {requirement} failed (the full log is {log.name}):\n"
                           + "".join(tail).rstrip())  # fmt: skip
    return path


def _is_vendored_llama_cpp(member: tarfile.TarInfo) -> bool:
    """True for <top>/vendor/llama.cpp/** entries; refuses absolute paths and `..`."""
    name = member.name
    if name.startswith("/") or ".." in Path(name).parts:
        raise InstallError(f"refusing the unsafe path {name!r} in the llama-cpp-python sdist")
    parts = name.split("/", 1)
    return len(parts) == 2 and parts[1].startswith(VENDOR_PREFIX)


def extract_vendored_llama_cpp(sdist: Path, dest: Path, progress: Progress) -> Path:
    """Extract only <top>/vendor/llama.cpp/** and return that directory."""
    source = dest / f"llama_cpp_python-{PINNED}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        progress(f"using the extracted sources {source}")
        return source
    progress(f"extracting vendored llama.cpp into {dest}")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if _is_vendored_llama_cpp(m)]
        with bar("extract", len(members), unit="files") as shown:
            # The "data" filter also refuses links leaving the tree and device files.
            tar.extractall(tmp, members=_counted(members, shown), filter="data")
    if not (
        tmp / f"llama_cpp_python-{PINNED}" / "vendor" / "llama.cpp" / "CMakeLists.txt"
    ).is_file():
        raise InstallError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt; delete it and retry")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return source


def _counted(items: list, shown) -> Iterator:
    for item in items:
        yield item
        shown.update(1)


def build_fraction(line: str) -> tuple[int, int] | None:
    """(done, total) from a line of a build's output: ninja's `[12/206]`, or
    make's `[ 45%]` as (45, 100); None for a line without one."""
    m = BUILD_PROGRESS.match(line)
    if not m:
        return None
    return (int(m[1]), 100) if m[1] is not None else (int(m[2]), int(m[3]))


def run_stage(cmd: list[str], log, stage: str) -> None:
    """Run one stage's command with all its output into `log` (none on the
    terminal), on a bar of the build's own fraction where its lines carry one
    (compiling), else of the lines it wrote (configuring). On failure the
    error names the log and ends with the output's last lines."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert proc.stdout is not None
    tail: deque[str] = deque(maxlen=FAILED_TAIL_LINES)  # for the error
    with bar(stage, unit="lines") as shown:
        for line in proc.stdout:
            log.write(line)
            tail.append(line)
            fraction = build_fraction(line)
            if fraction is None:
                if shown.unit == "lines":
                    shown.update(1)
                continue
            done, total = fraction
            if shown.total != total:  # the first fraction: from now on the bar counts it
                shown.unit = "%" if total == 100 else "steps"
                shown.reset(total)
            if done > shown.n:  # make's percentages can step back with parallel jobs
                shown.update(done - shown.n)
    if proc.wait() != 0:
        log.flush()
        raise InstallError(f"{stage} failed (exit {proc.returncode}); the full log is {log.name}; "
                           "its last lines:\n" + "".join(tail).rstrip())  # fmt: skip


def _foreign_libraries(binary: Path, build_dir: Path) -> list[str]:
    """ldd lines pointing into the build tree or unresolved (Linux only; [] elsewhere)."""
    if sys.platform != "linux" or not shutil.which("ldd"):
        return []
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    return [
        line.strip() for line in out.splitlines() if "not found" in line or str(build_dir) in line
    ]


def _generator_changed(build_dir: Path, generator: str) -> bool:
    """cmake refuses to reconfigure a build tree made with another generator."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return False
    return f"CMAKE_GENERATOR:INTERNAL={generator}\n" not in cache.read_text(errors="replace")


def _installed_ok(binary: Path) -> str | None:
    try:
        return llama_server_version(binary)
    except RuntimeError:
        return None


@contextlib.contextmanager
def _one_install_at_a_time(root: Path, progress: Progress):
    """Hold SPECGATE_HOME's install lock: a second install (another shell, a
    test worker) waits for the first, then finds its binary, instead of
    building into the same tree at the same time."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            progress(f"another install is under way ({holder}); waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        yield  # the lock ends with the file (or the process)


def install_llama_server(
    *, force: bool = False, jobs: int | None = None, progress: Progress = say
) -> Path:
    """Build llama-server (llama.cpp LLAMA_CPP_TAG) and install it under SPECGATE_HOME; return its path."""
    with _one_install_at_a_time(llama_cpp_dir(), progress):
        return _install(force=force, jobs=jobs, progress=progress)


def _install(*, force: bool, jobs: int | None, progress: Progress) -> Path:
    target = installed_llama_server_path()
    if not force and target.is_file():
        version = _installed_ok(target)
        if version:
            progress(f"llama-server is already installed: {target} ({version})")
            return target
        progress(f"{target} exists but does not run; rebuilding")

    progress("checking build tools")
    tools = check_prerequisites()
    generator = ["-G", "Ninja"] if tools["make or ninja"].endswith("ninja") else []

    root = llama_cpp_dir()
    log_path = logs_dir() / "llama-server-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    flags = cmake_flags()
    jobs = jobs or os.cpu_count() or 1
    build_dir = root / "build" / LLAMA_CPP_TAG
    with log_path.open("w") as log:
        progress(f"the build's full log: {log_path}")
        sdist = download_sdist(root / "src", log, progress)
        source = extract_vendored_llama_cpp(sdist, root / "src" / "extracted", progress)
        if force or _generator_changed(build_dir, "Ninja" if generator else "Unix Makefiles"):
            shutil.rmtree(build_dir, ignore_errors=True)
        started = time.monotonic()
        run_stage(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *flags],
                  log, "configure")  # fmt: skip
        progress(f"compiling llama-server with {jobs} jobs (several minutes)")
        run_stage(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
                  log, "compile")  # fmt: skip
    built = build_dir / "bin" / "llama-server"
    if not built.is_file():
        raise InstallError(f"the build finished but {built} is missing; see {log_path}")
    progress(f"built in {time.monotonic() - started:.0f} s")

    progress(f"installing {target}")
    _install_files(built, build_dir, target, progress)
    version = _installed_ok(target)
    if version is None:
        raise InstallError(f"the installed {target} does not run `--version`; see {log_path}")
    (target.parent / "version.json").write_text(
        json.dumps(
            {
                "llama_cpp_python": PINNED,
                "llama_cpp_tag": LLAMA_CPP_TAG,
                "version": version,
                "cmake_flags": flags,
                "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "platform": platform.platform(),
                "machine": platform.machine(),
            },
            indent=2,
        )
        + "\n"
    )
    progress(f"installed {target} ({version})")
    return target


def _atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _install_files(built: Path, build_dir: Path, target: Path, progress: Progress) -> None:
    """Copy the binary into place atomically; bring shared libs along only if it needs them."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.copy2(built, tmp)
    if _foreign_libraries(built, build_dir):
        # BUILD_SHARED_LIBS=OFF should make this unreachable; if a future llama.cpp
        # builds shared libs anyway, ship them beside the binary and point it there.
        progress("the build produced shared libraries; installing them beside the binary")
        for lib in [*(build_dir / "bin").glob("*.so*"), *(build_dir / "bin").glob("*.dylib")]:
            _atomic_copy(lib, target.parent / lib.name)
        if not shutil.which("patchelf"):
            tmp.unlink()
            raise InstallError(
                "llama-server was built against shared libraries; install patchelf and retry"
            )
        subprocess.run(["patchelf", "--set-rpath", "$ORIGIN", str(tmp)], check=True)
    os.replace(tmp, target)
    still = _foreign_libraries(target, build_dir)
    if still:
        raise InstallError(
            f"the installed {target} still needs libraries outside its directory: {still}"
        )


def run_cli(*, force: bool = False, jobs: int | None = None) -> int:
    """`specgate install-llama-server`: progress and errors on stderr, the path on stdout."""
    try:
        path = install_llama_server(force=force, jobs=jobs, progress=say)
    except (InstallError, OSError) as e:
        print(f"specgate: could not install llama-server: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
