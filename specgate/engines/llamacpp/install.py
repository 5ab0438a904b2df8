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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from specgate.engines.home import llama_cpp_dir, logs_dir
from specgate.engines.llamacpp.binary import (
    LLAMA_CPP_TAG,
    installed_llama_server_path,
    llama_server_version,
)

PINNED = "0.3.36"  # llama-cpp-python; vendors llama.cpp LLAMA_CPP_TAG (b11312)
SDIST_NAME = f"llama_cpp_python-{PINNED}.tar.gz"
# sha256 of that sdist as PyPI served it (two independent downloads agreed), so a
# swapped or corrupted file is refused before we compile and run anything from it.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = "vendor/llama.cpp/"
PROGRESS_EVERY_S = 5.0

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


def download_sdist(dest: Path, progress: Progress) -> Path:
    sdist = dest / SDIST_NAME
    if sdist.is_file():
        progress(f"using the downloaded sources {sdist}")
        return _verified(sdist)
    dest.mkdir(parents=True, exist_ok=True)
    progress(f"downloading llama-cpp-python {PINNED} sources (~77 MB) into {dest}")
    cmd = [
        *_pip_command(),
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"llama-cpp-python=={PINNED}",
        "-d",
        str(dest),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not sdist.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-10:])
        raise InstallError(f"downloading llama-cpp-python=={PINNED} failed:\n{tail}")
    return _verified(sdist)


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
        # The "data" filter also refuses links leaving the tree and device files.
        tar.extractall(tmp, members=members, filter="data")
    if not (
        tmp / f"llama_cpp_python-{PINNED}" / "vendor" / "llama.cpp" / "CMakeLists.txt"
    ).is_file():
        raise InstallError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt; delete it and retry")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return source


def _run_logged(cmd: list[str], log, progress: Progress, what: str) -> None:
    """Run cmd, all output to log; pass cmake's `[ NN%]` lines on at most every few seconds."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    last = 0.0
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        pct = re.match(r"\[\s*(\d+)%\]", line) or re.match(r"\[(\d+)/(\d+)\]", line)
        if pct and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            if pct.lastindex == 2:
                progress(f"  {what}: {100 * int(pct[1]) // int(pct[2])}%")
            else:
                progress(f"  {what}: {pct[1]}%")
    if proc.wait() != 0:
        log.flush()
        raise InstallError(f"{what} failed (exit {proc.returncode}); the full log is {log.name}")


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
    *, force: bool = False, jobs: int | None = None, progress: Progress = print
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
    sdist = download_sdist(root / "src", progress)
    source = extract_vendored_llama_cpp(sdist, root / "src" / "extracted", progress)

    build_dir = root / "build" / LLAMA_CPP_TAG
    if force or _generator_changed(build_dir, "Ninja" if generator else "Unix Makefiles"):
        shutil.rmtree(build_dir, ignore_errors=True)
    log_path = logs_dir() / "llama-server-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    flags = cmake_flags()
    jobs = jobs or os.cpu_count() or 1
    started = time.monotonic()
    with log_path.open("w") as log:
        progress(f"configuring (cmake); full log: {log_path}")
        _run_logged(
            ["cmake", "-S", str(source), "-B", str(build_dir), *generator, *flags],
            log,
            progress,
            "configure",
        )
        progress(f"compiling llama-server with {jobs} jobs (several minutes)")
        _run_logged(
            ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
            log,
            progress,
            "build",
        )
    built = build_dir / "bin" / "llama-server"
    if not built.is_file():
        raise InstallError(f"the build finished but {built} is missing; see {log_path}")
    progress(f"built in {time.monotonic() - started:.0f} s")

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
    """`specgate install-llama-server`: progress on stdout, the path last, errors on stderr."""
    try:
        path = install_llama_server(
            force=force, jobs=jobs, progress=lambda line: print(line, flush=True)
        )
    except (InstallError, OSError) as e:
        print(f"specgate: could not install llama-server: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
