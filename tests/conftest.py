"""Shared fixtures: tiny checkpoints and a real gateway on a loopback port.

The gateway runs as a real `specgate serve` subprocess (uvicorn, its own
process group), so tests talk to it exactly as a user's client would and
the test process is free to run mlx-lm as the reference side by side.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import llama_build
import pytest
import yaml

from engines.builders.tiny import build_qwen35_hybrid
from engines.home import llama_cpp_dir, peers_dir, specgate_home
from engines.llamacpp.binary import installed_llama_server_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Tests never download: any hub lookup fails at once instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def api(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None


def start_gateway(
    config: dict | None, workdir: Path, *, timeout: float = 120.0, home: Path | None = None,
    ranks: int = 1,
) -> Gateway:
    """Start `specgate serve` with this config (None: no --config, the embedded
    default); `ranks` > 1: under `mlx.launch -n ranks --backend ring` on loopback."""
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    if ranks > 1:
        launcher = Path(sys.executable).with_name("mlx.launch")
        args = [str(launcher), "-n", str(ranks), "--backend", "ring",
                "--starting-port", str(free_port()), "--", *args]  # fmt: skip
    if config is not None:
        config = config | {"server": {"host": "127.0.0.1", **config.get("server", {})}}
        cfg = workdir / "specgate.yaml"
        cfg.write_text(yaml.safe_dump(config))
        args += ["--config", str(cfg)]
    log_path = workdir / "gateway.log"
    env = os.environ | {"SPECGATE_HOME": str(home or workdir / "home"), "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not gw.alive():
                raise RuntimeError(f"gateway exited early:\n{gw.log()}")
            try:
                ready = httpx.get(gw.base_url + "/ready", timeout=2)
                if ready.status_code == 200:
                    return gw
                if "failed" in ready.json().get("models", {}).values():
                    break  # no point waiting: a model will not load
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gateway not ready:\n{gw.log()}")
    except BaseException:
        stop_gateway(gw)  # whatever went wrong (a non-JSON 500 on /ready too), none is left behind
        raise


def stop_gateway(gw: Gateway) -> None:
    if gw.alive():
        os.killpg(gw.process.pid, signal.SIGTERM)
        try:
            gw.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(gw.process.pid, signal.SIGKILL)
            gw.process.wait()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The embedded demo's layout and size: Qwen3.5 hybrid with mtp.* tensors."""
    return build_qwen35_hybrid(tmp_path_factory.mktemp("models") / "qwen35-tiny", seed=0)


@pytest.fixture(scope="session")
def gateway(tiny_model, tmp_path_factory):
    """One gateway for the session: "tiny" batches 8; "tiny-narrow" runs one
    request at a time and queues none, to show overload and slot release;
    "demo" is the shipped demo model with its MTP engine."""
    gw = start_gateway(
        {
            "server": {"max_body_bytes": 256 * 1024, "body_timeout_s": 2},
            "models": [
                {"id": "tiny", "path": str(tiny_model), "max_concurrent": 8, "max_context": 2048},
                {"id": "tiny-narrow", "path": str(tiny_model), "max_concurrent": 1,
                 "max_queue": 0, "max_context": 2048},
                {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"],
                 "mtp_depth": 3},
            ],
        },
        tmp_path_factory.mktemp("gateway"),
    )
    yield gw
    stop_gateway(gw)
    assert gw.process.returncode is not None


# -- a run: parallel workers, each in a SPECGATE_HOME of its own -----------------------


def pytest_configure(config):
    # The process that starts the run names it; its xdist workers inherit the
    # name (llama_build.py: a build is stopped only by the run that started it).
    if not hasattr(config, "workerinput"):
        os.environ.setdefault(llama_build.RUN, uuid.uuid4().hex[:12])


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller, or the only process: the run ends
        llama_build.stop(RUN_HOME)


# The run's SPECGATE_HOME (.ci/run gives an empty one), read before any test
# changes it: what is slow to build is built there once per run.
RUN_HOME = specgate_home()


@pytest.fixture(scope="session", autouse=True)
def _own_home(tmp_path_factory):
    """Each process that runs tests (an xdist worker, or the only one) works in
    a SPECGATE_HOME of its own, so no two write the same keys, logs, kernel
    verdicts or prefix-cache files; llama-server's build and the peers' venvs
    are shared through links to the run's home."""
    own = tmp_path_factory.mktemp("specgate-home")
    for shared in (llama_cpp_dir(RUN_HOME), peers_dir(RUN_HOME)):
        shared.mkdir(parents=True, exist_ok=True)
        (own / shared.name).symlink_to(shared)
    before = os.environ.get("SPECGATE_HOME")
    os.environ["SPECGATE_HOME"] = str(own)
    yield own
    if before is None:
        os.environ.pop("SPECGATE_HOME", None)
    else:
        os.environ["SPECGATE_HOME"] = before


# -- llama-server: built in the background while the rest runs ------------------------

# Building llama-server takes minutes (about 5 on 2 cores alone, more beside
# the tests). A test that needs it waits for the build before its own time
# limit starts; the fixture gets this one in case it must build it itself.
LLAMA_SERVER_BUILD_TIMEOUT = 1800


def _needs_llama_server(item) -> bool:
    return "llama_server_binary" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """Modules with a test that needs llama-server go last (whole modules, so
    their module fixtures stay together), and the build starts now."""
    later = {item.path for item in items if _needs_llama_server(item)}
    if not later:
        return
    items[:] = sorted(items, key=lambda item: item.path in later)  # stable: order kept otherwise
    for item in items:
        if _needs_llama_server(item):
            item.add_marker(pytest.mark.timeout(LLAMA_SERVER_BUILD_TIMEOUT), append=False)
            break
    if not installed_llama_server_path(RUN_HOME).is_file():
        llama_build.start(RUN_HOME)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside pytest-timeout's limit (tryfirst: this wrapper is the outer one)."""
    if _needs_llama_server(item):
        llama_build.wait(RUN_HOME, LLAMA_SERVER_BUILD_TIMEOUT)
    yield


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """specgate's own llama-server, as `specgate install-llama-server` builds
    it under the run's SPECGATE_HOME (llama_build.py built it in the
    background, or this builds it): .ci/run gives each run an empty one, so
    this is the install path itself, tested."""
    from engines.llamacpp.install import install_llama_server

    return install_llama_server()
