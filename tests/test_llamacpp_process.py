"""The managed llama-server process: start, crash recovery, stop, idle TTL, no orphans.

Everything runs the project's real llama-server build (llama_server_binary)
on a tiny Qwen3.5 hybrid exported to GGUF once for the module.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import listening_ports

from specgate.builders.gguf_export import export_gguf
from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.llamacpp.process import LlamaServer, LlamaServerError, ServerSpec

REPO = Path(__file__).resolve().parents[1]
LLAMA = pytest.mark.timeout(1800)  # the first use on a machine builds llama-server


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llamacpp-process")
    return export_gguf(build_qwen35_hybrid(d / "hf", seed=0), d / "tiny.gguf", outtype="f32")


@pytest.fixture
def home(tmp_path, monkeypatch, llama_server_binary) -> Path:
    # Set after llama_server_binary resolved (it builds under the real home),
    # so the servers' logs land in the test's own SPECGATE_HOME.
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def make_server(home, llama_server_binary):
    """LlamaServer factory; whatever is still running at the end is killed."""
    made: list[LlamaServer] = []

    def make(model: Path, **kw) -> LlamaServer:
        spec_kw = {k: kw.pop(k) for k in ("spec", "ctx_size", "parallel") if k in kw}
        spec = ServerSpec(model=model, ctx_size=spec_kw.pop("ctx_size", 512), threads=1, **spec_kw)
        server = LlamaServer(spec, binary=llama_server_binary,
                             **{"start_timeout": 60, "stop_grace": 5} | kw)  # fmt: skip
        made.append(server)
        return server

    yield make
    for server in made:
        server._kill_group(signal.SIGKILL)
        if server._proc is not None:
            server._proc.wait(timeout=10)


def drive(server: LlamaServer, body, timeout: float = 60):
    """Run body(server) in a fresh loop with a deadline; stop the server either way."""

    async def main():
        try:
            return await asyncio.wait_for(body(server), timeout)
        finally:
            await server.stop()

    return asyncio.run(main())


async def complete(url: str, n: int = 4) -> dict:
    body = {"prompt": "def main():", "n_predict": n, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False}  # fmt: skip
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await client.post(url + "/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def gone(pid: int) -> bool:
    """No such process (a zombie nobody has reaped yet counts as gone too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_spec_args():
    spec = ServerSpec(model=Path("m.gguf"), ctx_size=1024, parallel=2, threads=3,
                      spec={"type": "draft-mtp", "n_max": 4}, extra_args=["--foo"])  # fmt: skip
    args = spec.args(8080)
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--port") + 1] == "8080"
    assert {"--metrics", "--slots"} <= set(args)
    assert args[args.index("-c") + 1] == "1024" and args[args.index("-np") + 1] == "2"
    assert args[args.index("-t") + 1] == "3"
    assert args[args.index("--spec-type") + 1] == "draft-mtp"
    assert args[args.index("--spec-draft-n-max") + 1] == "4"
    assert args[-1] == "--foo"
    assert "--spec-type" not in ServerSpec(model=Path("m.gguf")).args(1)
    with pytest.raises(ValueError, match="--host"):
        ServerSpec(model=Path("m.gguf"), extra_args=["--host", "0.0.0.0"])
    # What would hide the line that says which port it bound.
    for quiet in (["--log-disable"], ["-lv", "2"], ["--log-verbosity", "x"], ["--verbosity"]):
        with pytest.raises(ValueError, match="`listening on` line"):
            ServerSpec(model=Path("m.gguf"), extra_args=quiet)
    ServerSpec(model=Path("m.gguf"), extra_args=["-lv", "4"])  # more is fine
    with pytest.raises(ValueError, match="draft-mtp, ngram-simple"):
        ServerSpec(model=Path("m.gguf"), spec={"type": "ngram", "n_max": 2})
    # Each n-gram type sizes its drafts with its own flag.
    simple = ServerSpec(model=Path("m.gguf"), spec={"type": "ngram-simple", "n_max": 6}).args(1)
    assert simple[simple.index("--spec-type") + 1] == "ngram-simple"
    assert simple[simple.index("--spec-ngram-simple-size-m") + 1] == "6"
    assert "--spec-draft-n-max" not in simple
    mod = ServerSpec(model=Path("m.gguf"), spec={"type": "ngram-mod", "n_max": 16}).args(1)
    assert mod[mod.index("--spec-ngram-mod-n-max") + 1] == "16"
    assert mod[mod.index("--spec-ngram-mod-n-min") + 1] == "1"


@LLAMA
def test_start_crash_restart_stop(gguf, make_server, home):
    server = make_server(gguf)
    pids = []

    async def body(s: LlamaServer):
        await s.start()
        pids.append(s.pid)
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(s.base_url + "/health")).status_code == 200
        assert (await complete(s.base_url))["tokens_predicted"] == 4
        # Bound to loopback only, as the command line says, to a port of its
        # own choosing (0): the one specgate talks to is the one it listens on.
        argv = Path(f"/proc/{s.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--host") + 1] == b"127.0.0.1"
        assert argv[argv.index(b"--port") + 1] == b"0"
        assert listening_ports(s.pid) == {s.port}
        assert s.log_path.parent == home / "logs" and s.log_path.stem.startswith("llama-server-tiny-")
        assert "llama" in s.log_tail(50)

        os.kill(s.pid, signal.SIGKILL)
        # Hang guards, not speed checks: a loaded machine (the suite's other
        # workers) can take seconds to reap a killed llama-server.
        await until(lambda: not s.alive, 60, "the killed server to be noticed")
        await until(lambda: s.last_exit_code is not None, 60, "the watcher to record the exit")
        assert s.last_exit_code == -signal.SIGKILL
        await s.ensure_running()
        assert s.alive and s.restarts == 1 and s.pid != pids[0]
        assert listening_ports(s.pid) == {s.port}  # the new process's port, read at this start
        pids.append(s.pid)
        assert (await complete(s.base_url))["tokens_predicted"] == 4

    drive(server, body)
    assert not server.alive and server.pid is None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    asyncio.run(server.stop())  # idempotent


@LLAMA
def test_draft_mtp_metrics(gguf, make_server):
    server = make_server(gguf, spec={"type": "draft-mtp", "n_max": 2})

    async def body(s: LlamaServer):
        await s.ensure_running()
        await complete(s.base_url, 16)
        async with httpx.AsyncClient(trust_env=False) as client:
            return (await client.get(s.base_url + "/metrics")).text

    assert "llamacpp:spec_decode_num_drafts_total" in drive(server, body)


@LLAMA
def test_bad_model_fails_with_log_tail(tmp_path, make_server):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"this is not a gguf file")
    server = make_server(bad, max_start_failures=3, backoff_initial=0.1)

    async def body(s: LlamaServer):
        with pytest.raises(LlamaServerError) as e:
            await s.start()
        tail = s.log_tail(3)
        assert "exited with code" in str(e.value) and tail and tail in str(e.value)
        # ensure_running backs off after each failed start (0.1, 0.2, 0.4 s here:
        # start() above was the first) and gives up clearly after 3 attempts.
        t0 = time.monotonic()
        with pytest.raises(LlamaServerError, match="failed to start 4 times in a row"):
            await s.ensure_running()
        assert time.monotonic() - t0 >= 0.7
        assert not s.alive

    drive(server, body)


@LLAMA
def test_idle_ttl_stops_and_ensure_running_restarts(gguf, make_server):
    server = make_server(gguf, ttl=1.0)

    async def body(s: LlamaServer):
        await s.start()
        pid = s.pid
        await until(lambda: not s.alive, 60, "the idle TTL to stop the server")
        assert gone(pid)
        await s.ensure_running()
        assert s.alive and s.restarts == 0  # an idle stop is not a crash
        assert (await complete(s.base_url))["tokens_predicted"] == 4

    drive(server, body)


ORPHAN_SCRIPT = """
import asyncio, sys
from pathlib import Path
from specgate.engines.llamacpp.process import LlamaServer, ServerSpec

async def main():
    s = LlamaServer(ServerSpec(model=Path(sys.argv[1]), ctx_size=512, threads=1),
                    binary=sys.argv[2], start_timeout=60)
    await s.start()
    print(s.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@LLAMA
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkilled_gateway_takes_its_llama_server_along(gguf, home, llama_server_binary):
    gateway = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT, str(gguf), str(llama_server_binary)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = None
    try:
        line = gateway.stdout.readline()  # bounded by the script's own start_timeout
        assert line.strip().isdigit(), gateway.stderr.read() if gateway.poll() is not None else line
        child = int(line)
        assert not gone(child)
        gateway.kill()
        gateway.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not gone(child):
            assert time.monotonic() < deadline, f"llama-server {child} outlived its gateway"
            time.sleep(0.05)
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(timeout=10)
        if child is not None and not gone(child):
            os.kill(child, signal.SIGKILL)
