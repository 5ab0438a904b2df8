"""Getting llama-server: where specgate looks for it, and building it for real.

The lookup tests use fake `llama-server` shell scripts: they only prove which
path wins, they are never run as a server. The one real test builds (or
reuses) the actual llama-server under the default SPECGATE_HOME.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from specgate.engines.llamacpp import install
from specgate.engines.llamacpp.binary import (
    LLAMA_CPP_TAG,
    LlamaServerMissing,
    find_llama_server,
    installed_llama_server_path,
    llama_server_version,
)


def fake_executable(path: Path) -> Path:
    """A stand-in named llama-server, for lookup-order tests only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'version: 0.0.0-fake (build 0, commit fake)' >&2\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty SPECGATE_HOME and a PATH with no llama-server on it."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECGATE_HOME", str(home))
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return home


def put_on_path(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")


def test_configured_path_wins(clean_env: Path, tmp_path: Path, monkeypatch) -> None:
    configured = fake_executable(tmp_path / "mine" / "llama-server")
    put_on_path(fake_executable(tmp_path / "on-path" / "llama-server").parent, monkeypatch)
    fake_executable(installed_llama_server_path())
    assert find_llama_server(str(configured)) == configured


def test_path_comes_before_specgate_build(clean_env: Path, tmp_path: Path, monkeypatch) -> None:
    on_path = fake_executable(tmp_path / "on-path" / "llama-server")
    put_on_path(on_path.parent, monkeypatch)
    fake_executable(installed_llama_server_path())
    assert find_llama_server() == on_path


def test_specgate_build_is_found_last(clean_env: Path) -> None:
    built = fake_executable(installed_llama_server_path())
    assert built == clean_env / "llama.cpp" / LLAMA_CPP_TAG / "bin" / "llama-server"
    assert find_llama_server() == built
    assert llama_server_version(built) == "version: 0.0.0-fake (build 0, commit fake)"


def test_missing_says_what_to_run(clean_env: Path) -> None:
    with pytest.raises(LlamaServerMissing, match="specgate install-llama-server") as e:
        find_llama_server()
    assert isinstance(e.value, FileNotFoundError)


def test_configured_path_that_does_not_exist(clean_env: Path, tmp_path: Path) -> None:
    fake_executable(installed_llama_server_path())  # must not be used instead
    missing = tmp_path / "nowhere" / "llama-server"
    with pytest.raises(LlamaServerMissing, match=f"{missing}.*does not exist"):
        find_llama_server(str(missing))


def test_configured_path_not_executable(clean_env: Path, tmp_path: Path) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text("not a program")
    with pytest.raises(LlamaServerMissing, match="not an executable"):
        find_llama_server(str(plain))


def test_prerequisites_name_whats_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(
        install.shutil, "which", lambda name: None if name == "cmake" else real_which(name)
    )
    with pytest.raises(install.InstallError, match="cmake") as e:
        install.check_prerequisites()
    assert "compiler" not in str(e.value)  # only what is actually missing
    assert "apt-get install cmake build-essential" in str(e.value) or "brew" in str(e.value)


def test_sdist_filter_refuses_unsafe_paths() -> None:
    import tarfile

    for name in ("/etc/passwd", "llama_cpp_python-0.3.36/vendor/llama.cpp/../../x"):
        with pytest.raises(install.InstallError, match="unsafe"):
            install._is_vendored_llama_cpp(tarfile.TarInfo(name))
    assert install._is_vendored_llama_cpp(
        tarfile.TarInfo("llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt")
    )
    assert not install._is_vendored_llama_cpp(tarfile.TarInfo("llama_cpp_python-0.3.36/setup.py"))


def test_installed_llama_server_runs(llama_server_binary: Path) -> None:
    """The real thing: the run's llama-server build (conftest.py; its
    fixture puts this test after the rest, while the build runs), then a
    second install that finds and reuses it."""
    path = install.install_llama_server()
    assert path == llama_server_binary
    assert path == installed_llama_server_path()
    version = llama_server_version(path)
    assert version.startswith("version:") and "build" in version
    assert (path.parent / "version.json").is_file()
    assert LLAMA_CPP_TAG in (path.parent / "version.json").read_text()
    if shutil.which("ldd"):
        ldd = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        assert "not found" not in ldd
        assert "libllama" not in ldd and "libggml" not in ldd  # statically linked


def test_cli_fails_with_the_message(clean_env: Path, monkeypatch, capsys) -> None:
    from specgate.gateway.operator.cli import main

    def no_cmake() -> dict[str, str]:
        raise install.InstallError("building llama-server needs cmake")

    monkeypatch.setattr(install, "check_prerequisites", no_cmake)
    assert main(["install-llama-server"]) == 1
    assert "needs cmake" in capsys.readouterr().err


def test_tampered_sdist_is_refused_and_deleted(tmp_path: Path) -> None:
    sdist = tmp_path / install.SDIST_NAME
    sdist.write_bytes(b"not the llama-cpp-python sources")
    with pytest.raises(install.InstallError, match="sha256"):
        install.download_sdist(tmp_path, log=None, progress=lambda line: None)  # found: no log
    assert not sdist.exists()
