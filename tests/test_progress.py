"""Progress of the long commands (specgate/engines/progress.py), as a user sees it.

Each command runs as a real subprocess twice: with stderr on a pseudo-terminal
(live tqdm bars, redrawn with \\r) and with stderr on a pipe (a log, CI, a
service: plain lines, no \\r, no escape sequences). stdout stays a pipe: it
holds the command's own output only. Everything is on loopback and small:
demo-model and demo-drafter on ten stdlib files and a few steps, pull from a
local mirror (test_model_sources.Mirror), and install-llama-server's pieces
(its pip download against a local index, its build stages on a tiny CMake
project); the full build is conftest's `llama_server_binary`, not this file's.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
import tty
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import REPO
from test_model_sources import Mirror

ESC = "\x1b["


def run(argv: list[str], *, terminal: bool, env: dict | None = None,
        timeout: float = 240) -> tuple[int, str, str]:  # fmt: skip
    """(exit status, stdout, stderr) of argv, its stderr a pseudo-terminal
    (raw, 100 columns: no newline translation to blur \\r) or a pipe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))} | (
        env or {}
    )
    env.pop("TQDM_DISABLE", None)
    if not terminal:
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)  # fmt: skip
        return done.returncode, done.stdout, done.stderr
    main, sub = os.openpty()
    tty.setraw(sub)
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=sub)  # fmt: skip
    os.close(sub)
    chunks: list[bytes] = []

    def drain() -> None:  # the terminal's side must be read, or the child blocks on it
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=timeout)
    reader.join(timeout=30)
    os.close(main)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def percentages(text: str, stage: str) -> set[int]:
    """The percentages shown for `stage` (a bar's redraws or a log's lines)."""
    return {int(p) for p in re.findall(rf"(?:^|[\r\n]){re.escape(stage)}:\s*(\d+)%", text)}


def assert_plain(text: str) -> None:
    """Lines a log keeps readable: no carriage return, no escape sequence."""
    assert "\r" not in text and ESC not in text, repr(text[-2000:])


def assert_redrawn(text: str, stage: str) -> None:
    """A live bar: redrawn in place (\\r without a newline), not line after line."""
    assert re.search(rf"\r{re.escape(stage)}:", text), repr(text[-2000:])


# -- demo-model, demo-drafter --------------------------------------------------------

DEMO = ["--size", "tiny", "--steps", "30", "--batch-size", "1", "--seq-len", "16",
        "--max-files", "10"]  # fmt: skip


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_demo_model_shows_its_stages_and_steps(tmp_path, terminal):
    out = tmp_path / "demo"
    rc, stdout, stderr = run([sys.executable, "-m", "specgate", "demo-model", *DEMO,
                              "--eval-tokens", "200", "--out", str(out)],
                             terminal=terminal, env={"SPECGATE_HOME": str(tmp_path)})  # fmt: skip
    assert rc == 0, stderr[-3000:]
    assert stdout == f"{out}\n"  # the model's path alone: progress is stderr's
    for stage in ("tokenize train", "tokenize heldout", "train"):
        assert 100 in percentages(stderr, stage), stage
    assert "loss trunk" in stderr and "evaluating on 200 held-out tokens" in stderr
    if terminal:
        assert_redrawn(stderr, "train")
    else:
        assert_plain(stderr)
        steps = [line for line in stderr.splitlines() if line.startswith("train:")]
        # start, each tenth of 30 steps, end: the steps' lines, never one per step
        assert len(percentages(stderr, "train")) >= 3 and len(steps) <= 12, steps
        assert re.search(r"train: 100% \(30/30 steps\) .* left, .*loss trunk \d", stderr), stderr
        # --max-files changes the corpus: the work dir made with another says so
        rc, _, stderr = run([sys.executable, "-m", "specgate", "demo-model", *DEMO[:-1], "11",
                             "--out", str(out)], terminal=False)  # fmt: skip
        assert rc == 2 and "holds a corpus of 10 files, not 11; remove it" in stderr, stderr


def test_demo_drafter_shows_its_steps_and_evaluation(tmp_path):
    out = tmp_path / "drafter"
    argv = [sys.executable, "-m", "specgate", "demo-drafter", "--steps", "4", "--batch-size", "1",
            "--seq-len", "32", "--anchors", "4", "--block-size", "3", "--max-files", "10",
            "--eval-prompts", "1", "--eval-new-tokens", "4", "--out", str(out)]  # fmt: skip
    rc, stdout, stderr = run(argv, terminal=False, env={"SPECGATE_HOME": str(tmp_path)})
    assert rc == 0, stderr[-3000:]
    assert stdout == f"{out}\n"
    assert_plain(stderr)
    assert 100 in percentages(stderr, "train") and "draft-1 acc" in stderr
    assert 100 in percentages(stderr, "evaluate")


# -- pull ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    src = tmp_path_factory.mktemp("mirror-src")
    (src / "config.json").write_text("{}")
    (src / "weights").write_bytes(os.urandom(24 << 20))  # a few of huggingface_hub's chunks
    server = Mirror({"org/big": {"config.json": src / "config.json",
                                 "model.safetensors": src / "weights"}})  # fmt: skip
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_pull_shows_files_and_bytes(mirror, tmp_path, terminal):
    env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": mirror.url, "HF_HUB_DISABLE_XET": "1"}
    rc, stdout, stderr = run([sys.executable, "-m", "specgate", "pull", "org/big"],
                             terminal=terminal, env=env)  # fmt: skip
    assert rc == 0, stderr[-3000:]
    assert stdout.startswith("downloaded to ") and "%" not in stdout
    if terminal:  # huggingface_hub's own bars
        assert "\r" in stderr and "100%" in stderr, repr(stderr)
    else:
        assert_plain(stderr)
        assert re.search(r"^files: 100% \(2/2 files\)", stderr, re.M), stderr
        assert re.search(r"^download: 100% \(25\.2M/25\.2MB\)", stderr, re.M), stderr
        assert "Downloading bytes" not in stderr  # its second byte bar stays quiet


# -- install-llama-server's pieces ---------------------------------------------------


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A package index on loopback (PEP 503's simple HTML) with one sdist of
    2 MiB (pip draws progress only above 512 KiB) whose in-tree build backend
    needs nothing installed, as pip download prepares an sdist's metadata."""
    root = tmp_path_factory.mktemp("index")
    pkg = tmp_path_factory.mktemp("pkg") / "tinypkg-1.0"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                        'backend-path = ["."]\n')  # fmt: skip
    (pkg / "backend.py").write_text(
        "import os\n"
        "def prepare_metadata_for_build_wheel(directory, config_settings=None):\n"
        "    info = os.path.join(directory, 'tinypkg-1.0.dist-info')\n"
        "    os.makedirs(info)\n"
        "    with open(os.path.join(info, 'METADATA'), 'w') as f:\n"
        "        f.write('Metadata-Version: 2.1\\nName: tinypkg\\nVersion: 1.0\\n')\n"
        "    return 'tinypkg-1.0.dist-info'\n"
    )
    (pkg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
    (pkg / "payload.bin").write_bytes(os.urandom(2 << 20))
    (root / "simple" / "tinypkg").mkdir(parents=True)
    shutil.make_archive(str(root / "simple" / "tinypkg" / "tinypkg-1.0"), "gztar", pkg.parent,
                        pkg.name)  # fmt: skip
    (root / "simple" / "tinypkg" / "index.html").write_text(
        '<html><body><a href="tinypkg-1.0.tar.gz">tinypkg-1.0.tar.gz</a></body></html>\n'
    )
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()
    server.server_close()


PIP_DOWNLOAD = """
import sys
from pathlib import Path
from specgate.engines.llamacpp.install import pip_download, say
with open(sys.argv[2], "w") as log:
    print(pip_download("tinypkg==1.0", "tinypkg-1.0.tar.gz", Path(sys.argv[1]), log, say))
"""


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_install_downloads_with_a_byte_bar(index, tmp_path, terminal):
    """install-llama-server's download (download_sdist calls pip_download),
    from a local index through this environment's pip."""
    env = {"PIP_INDEX_URL": index, "PIP_NO_CACHE_DIR": "1", "PIP_CONFIG_FILE": os.devnull,
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "NO_PROXY": "127.0.0.1"}  # fmt: skip
    log = tmp_path / "log"
    rc, stdout, stderr = run([sys.executable, "-c", PIP_DOWNLOAD, str(tmp_path / "d"), str(log)],
                             terminal=terminal, env=env)  # fmt: skip
    assert rc == 0, stderr[-3000:]
    assert stdout == f"{tmp_path / 'd' / 'tinypkg-1.0.tar.gz'}\n"
    assert {0, 100} <= percentages(stderr, "download"), stderr
    assert "Progress " not in stderr and "Progress " not in log.read_text()  # pip's, parsed
    assert "Saved" in log.read_text()  # the rest of pip's output is the log's
    if terminal:
        assert_redrawn(stderr, "download")
    else:
        assert_plain(stderr)
        assert re.search(r"^download: 100% \(2\.\d+M/2\.\d+MB\)", stderr, re.M), stderr


CMAKE_PROJECT = """cmake_minimum_required(VERSION 3.10)
project(tiny C)
add_executable(tiny main.c {sources})
add_executable(broken broken.c)
"""
BUILD = """
import sys
from specgate.engines.llamacpp.install import InstallError, run_stage
src, build, generator, log_path = sys.argv[1:]
with open(log_path, "w") as log:
    run_stage(["cmake", "-S", src, "-B", build, "-G", generator], log, "configure")
    run_stage(["cmake", "--build", build, "--target", "tiny", "-j", "1"], log, "compile")
    try:
        run_stage(["cmake", "--build", build, "--target", "broken"], log, "compile")
    except InstallError as e:
        print(e)
"""


@pytest.mark.skipif(not shutil.which("cmake") or not shutil.which("cc"), reason="needs cmake, cc")
@pytest.mark.parametrize(("generator", "terminal"), [("Ninja", True), ("Ninja", False),
                                                     ("Unix Makefiles", False)])  # fmt: skip
def test_install_build_stages_count_the_builds_own_progress(tmp_path, generator, terminal):
    """install-llama-server's configure and compile stages (run_stage) on a
    real CMake build: ninja's [n/N] or make's [ NN%] become the bar, the
    compiler's lines stay in the log, and a failed step names the log and
    ends with its error."""
    tool = {"Ninja": "ninja", "Unix Makefiles": "make"}[generator]
    if not shutil.which(tool):
        pytest.skip(f"needs {tool}")
    src = tmp_path / "src"
    src.mkdir()
    names = [f"f{i}.c" for i in range(8)]
    for i, name in enumerate(names):
        (src / name).write_text(f"int f{i}(void) {{ return {i}; }}\n")
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    (src / "broken.c").write_text("int main(void) { return undeclared_name; }\n")
    (src / "CMakeLists.txt").write_text(CMAKE_PROJECT.format(sources=" ".join(names)))
    log = tmp_path / "build.log"
    rc, stdout, stderr = run([sys.executable, "-c", BUILD, str(src), str(tmp_path / "b"),
                              generator, str(log)], terminal=terminal)  # fmt: skip
    assert rc == 0, stderr[-3000:]
    compiled = percentages(stderr, "compile")
    # A line at each tenth in a log; a terminal's redraws are at most 10 a second.
    assert {0, 100} <= compiled and (terminal or len(compiled) >= 5), stderr
    assert "Building C object" in log.read_text() and "Building C object" not in stderr
    assert re.search(r"configure: \d+ ?lines", stderr), stderr
    # the failed build: the log's path, then the compiler's own words
    assert re.search(rf"compile failed \(exit \d+\); the full log is {re.escape(str(log))}", stdout)
    assert "undeclared_name" in stdout.split("its last lines:")[1]
    if terminal:
        assert_redrawn(stderr, "compile")
    else:
        assert_plain(stderr)
