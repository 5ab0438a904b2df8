"""llama-server children that hang: found out, killed, restarted, and no hang for the model.

A hung process keeps its listening socket, so connections are accepted and
nothing answers. The hang is injected with SIGSTOP (the one fake here: a real
llama-server, frozen by the kernel); everything else is real: specgate's own
llama-server build, the demo GGUF, the engines as `specgate serve` builds
them, and a real gateway with the openai SDK as its client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from specgate.builders.gguf_export import export_gguf
from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.base import (
    EngineError,
    GenerationRequest,
    Plan,
    PrefillProgress,
    SamplingParams,
    TokenEvent,
)
from specgate.engines.llamacpp import engine as llamacpp_engine
from specgate.engines.llamacpp.build import build_llamacpp_engines
from specgate.engines.llamacpp.engine import LlamaCppEngine
from specgate.engines.llamacpp.process import LlamaServer, ServerSpec
from specgate.engines.settings import LlamaServerSettings, MTPSettings
from tests.conftest import start_gateway, stop_gateway
from tests.test_llamacpp_gateway import llama_servers
from tests.test_llamacpp_process import gone

pytestmark = pytest.mark.timeout(1800)  # the first use on a machine builds llama-server



@dataclass(frozen=True)
class Health:
    interval: float = 2.0
    timeout: float = 3.0
    failures: int = 3


NEVER = Health(interval=3600.0)  # health checks off: what else catches the hang is tested
FAST = Health(interval=0.3, timeout=1.0, failures=3)


@pytest.fixture(scope="module")
def demo_gguf(llama_server_binary) -> Path:
    # Resolved under the real SPECGATE_HOME (exported there once), before
    # `home` points it at the test's own directory for the servers' logs.
    from specgate.gateway.serving.builtins import builtin_path

    return builtin_path("builtin:demo-gguf")


@pytest.fixture
def home(tmp_path, monkeypatch, llama_server_binary) -> Path:
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _stopped(pid: int) -> bool:
    """No thread of `pid` can run: each stopped, or dead (the process may be killed meanwhile)."""
    try:
        tasks = Path(f"/proc/{pid}/task")
        if tasks.is_dir():  # Linux: each thread's state follows the ')' ending its name
            return all(p.read_text().rpartition(")")[2].split()[0] in "TtZX"
                       for p in tasks.glob("*/stat"))  # fmt: skip
        done = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        return not done.stdout.strip() or done.stdout.strip()[0] in "TZ"
    except FileNotFoundError:  # a thread (or the process) ended while we looked: look again
        return not Path(f"/proc/{pid}").exists() and Path("/proc/self").exists()


def freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until it has stopped. The signal wakes one
    thread to stop the others; on a busy machine that thread may wait for a
    core while another answers a request (found under `-n 4`: a 'frozen'
    llama-server answered /tokenize)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not _stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} did not stop within 30 s"
        time.sleep(0.005)


COUNTING = """
import mmap, sys, threading, time
with open(sys.argv[1], "r+b") as f:
    shared = mmap.mmap(f.fileno(), 8)
def count():
    n = 0
    while True:
        n += 1
        shared[:8] = n.to_bytes(8, "little")
threading.Thread(target=count, daemon=True).start()
time.sleep(600)  # the main thread, which the kernel asks to stop the others
"""


def test_freeze_returns_once_no_thread_of_the_process_runs(tmp_path):
    """A thread that runs on while a SIGSTOP takes effect is how a 'frozen'
    llama-server answered a request under load; after freeze() none runs."""
    counter = tmp_path / "counter"
    counter.write_bytes(bytes(8))
    child = subprocess.Popen([sys.executable, "-c", COUNTING, str(counter)])
    try:
        while counter.read_bytes() == bytes(8):
            time.sleep(0.01)
        for _ in range(5):
            freeze(child.pid)
            at_stop = counter.read_bytes()
            time.sleep(0.2)
            assert counter.read_bytes() == at_stop
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()


@contextlib.contextmanager
def frozen(*pids: int):
    """SIGSTOP these processes; SIGCONT whichever still exist afterwards."""
    for pid in pids:
        freeze(pid)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def until(cond, timeout: float, what: str, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)


def engines_for(gguf: Path, binary: Path, names: list[str], *, health: Health,
                progress_timeout: float = 600.0, max_context: int = 1024,
                extra_args: tuple[str, ...] = ()) -> dict[str, LlamaCppEngine]:
    # One thread: two would spin at each op's barrier, and on a shared
    # machine wait for each other for seconds.
    server = LlamaServerSettings(threads=1, extra_args=extra_args,
                                 progress_timeout_s=progress_timeout,
                                 health_interval_s=health.interval,
                                 health_timeout_s=health.timeout,
                                 health_failures=health.failures)  # fmt: skip
    built, refused = build_llamacpp_engines(
        "demo-gguf", gguf, names, settings={"llamacpp_mtp": MTPSettings(depth=2)}, server=server,
        binary=str(binary), max_context=max_context, max_concurrent=1, max_queue=0,
    )
    assert not refused, refused
    return built  # type: ignore[return-value]


def run_engines(engines: dict[str, LlamaCppEngine], body, timeout: float = 120):
    """Start the engines, run body(engines) with a hang guard, stop them either way."""

    async def main():
        try:
            for engine in engines.values():
                await engine.start()
            return await asyncio.wait_for(body(engines), timeout)
        finally:
            for engine in engines.values():
                await engine.stop()

    try:
        result = asyncio.run(main())
    finally:
        for engine in engines.values():  # whatever a failed test left running
            engine.server._kill_group(signal.SIGKILL)
    assert all(e.server.pid is None for e in engines.values())  # stop() reaped them all
    return result


def request(prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest("r", "demo-gguf", prompt, SamplingParams(temperature=0.0),
                             max_tokens, Plan("llamacpp", "none", 0, "spec_on"))


# -- the health check ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llamacpp-faults")
    return export_gguf(build_qwen35_hybrid(d / "hf", seed=0), d / "tiny.gguf", outtype="f32")


def test_a_stopped_process_is_found_stuck_killed_and_restarted(tiny_gguf, home,
                                                                llama_server_binary):
    server = LlamaServer(ServerSpec(tiny_gguf, ctx_size=512, threads=1),
                         binary=llama_server_binary, start_timeout=60, stop_grace=5,
                         health_interval=FAST.interval, health_timeout=FAST.timeout,
                         health_failures=FAST.failures)
    seen: list[str] = []

    async def main():
        try:
            await server.start()
            first = server.pid
            assert server.problem is None
            with frozen(first):
                # The first missed answer is a problem at once; the kill comes
                # at the third. The restart takes at least one /health poll of
                # the new process (0.2 s): long enough to see the problem then.
                await until(lambda: server.problem is not None, 30, "the hang to be noticed")
                seen.append(server.problem)
                await until(lambda: "stuck" in (server.problem or ""), 30, "the kill")
                seen.append(server.problem)
                await until(lambda: server.running and server.pid != first, 60, "a restart")
            assert gone(first) and server.problem is None and server.restarts == 1
            async with httpx.AsyncClient(trust_env=False) as client:
                r = await client.post(server.base_url + "/completion",
                                      json={"prompt": "def main():", "n_predict": 4})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        finally:
            await server.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        server._kill_group(signal.SIGKILL)
    assert "did not answer /health within 1 s (1 time in a row; killed at 3)" in seen[0], seen
    assert "did not answer /health 3 times in a row" in seen[1] and "restarting" in seen[1], seen
    assert not server.alive


# -- requests on a hung process ------------------------------------------------------


async def stream_until_frozen(engine: LlamaCppEngine, got: list[TokenEvent]) -> None:
    """Stream a long generation, freezing the server after two events."""
    pid = engine.server.pid
    try:
        async for event in engine.generate(request([1, 2, 3], 900)):
            if not isinstance(event, TokenEvent):
                continue
            got.append(event)
            if len(got) == 2:
                freeze(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_request_fails_when_llama_server_makes_no_progress(demo_gguf, home,
                                                             llama_server_binary):
    # Health checks off: the progress deadline alone ends the request.
    engines = engines_for(demo_gguf, llama_server_binary, ["llamacpp"], health=NEVER,
                          progress_timeout=5.0)

    async def body(engines):
        engine, got = engines["llamacpp"], []
        with pytest.raises(EngineError) as e:
            await stream_until_frozen(engine, got)
        assert "made no progress for 5 s" in str(e.value) and "demo-gguf" in str(e.value)
        # (tokens already in the socket still arrive after the freeze)
        assert len(got) >= 2 and all(ev.finish_reason is None for ev in got)

    run_engines(engines, body, timeout=60)


def test_requests_on_a_stuck_process_fail_promptly_and_it_restarts(demo_gguf, home,
                                                                   llama_server_binary):
    # No progress deadline to speak of: the health check ends the request.
    engines = engines_for(demo_gguf, llama_server_binary, ["llamacpp"], health=FAST,
                          progress_timeout=600.0)
    problems: list[str] = []

    async def body(engines):
        engine, got = engines["llamacpp"], []
        first = engine.server.pid
        assert engine.problem() is None
        with pytest.raises(EngineError) as e:
            await stream_until_frozen(engine, got)
        msg = str(e.value)
        assert "did not answer /health" in msg and "will be restarted" in msg, msg
        # Restarting takes at least one /health poll of the new process (0.2 s).
        problems.append(engine.problem())
        await until(lambda: engine.server.running and engine.problem() is None, 60, "a restart")
        assert gone(first) and engine.server.pid != first
        events = [ev async for ev in engine.generate(request([1, 2, 3], 8))]
        assert sum(len(ev.token_ids) for ev in events) == 8

    run_engines(engines, body, timeout=90)
    for p in problems:
        assert p is not None and p.startswith("llama-server (llamacpp) for model 'demo-gguf': ") and "stuck" in p


def test_a_long_prefill_is_progress(demo_gguf, home, llama_server_binary):
    """llama-server streams nothing while it evaluates a prompt but its
    progress events: a prefill longer than the deadline still completes."""
    timeout = 2.0
    # Small batches (one progress event each), and a prompt long enough that
    # its prefill spans the pauses below.
    engines = engines_for(demo_gguf, llama_server_binary, ["llamacpp"], health=NEVER,
                          progress_timeout=timeout, max_context=4200,
                          extra_args=("-b", "8", "-ub", "8"))
    prompt = [10 + i for i in range(2000)]

    async def body(engines):
        engine = engines["llamacpp"]
        pid, first_token = engine.server.pid, asyncio.Event()
        paused = 0.0

        async def slow_down():
            # Stretch the prefill in wall time, each pause well under the
            # deadline, until the pauses add up to more than the deadline
            # (a second more); then the prefill runs on at full speed.
            nonlocal paused
            while not first_token.is_set() and paused < timeout + 1:
                freeze(pid)
                await asyncio.sleep(0.5)
                os.kill(pid, signal.SIGCONT)
                paused += 0.5
                await asyncio.sleep(0.1)

        pauser = asyncio.create_task(slow_down())
        n, progress = 0, []
        try:
            async for event in engine.generate(request(prompt, 4)):
                if isinstance(event, PrefillProgress):  # llama-server's, passed on
                    progress.append(event)
                    continue
                first_token.set()
                n += len(event.token_ids)
        finally:
            first_token.set()
            await pauser
        assert n == 4
        processed = [p.processed for p in progress]
        assert len(processed) > 1 and processed == sorted(processed), processed
        assert all(p.total == len(prompt) and p.processed < p.total for p in progress)
        # The test means something only if the prefill outlasted the deadline.
        assert paused > timeout, f"the prefill took only {paused:.1f} s of pauses: too fast"

    run_engines(engines, body, timeout=300)


# -- tokenizing when a process hangs -------------------------------------------------

TEXTS = [
    "def fibonacci(n):\n    return n",
    "héllo wörld – naïve café, 日本語のテキスト, Ελληνικά 🎉👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",  # special tokens
    "  leading spaces\t\ttabs\r\n\n\ntrailing  ",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Sort [3, 1, 2] — ünïcödé too."}]


async def answers(engine: LlamaCppEngine) -> tuple:
    return ([await engine.encode(t) for t in TEXTS], await engine.render_chat(MESSAGES),
            await engine.chat_template())


def test_tokenizing_survives_a_hung_process(demo_gguf, home, llama_server_binary, monkeypatch):
    # Health checks off, so the hung process stays hung: its sibling tokenizes.
    # A hung process is given up on after 2 s here (5 s in the product): three
    # such waits are the test's time, and a live llama-server answers in ms.
    monkeypatch.setattr(llamacpp_engine, "QUICK_TIMEOUT_S", 2.0)
    engines = engines_for(demo_gguf, llama_server_binary, ["llamacpp", "llamacpp_mtp"],
                          health=NEVER)

    async def body(engines):
        plain, mtp = engines["llamacpp"], engines["llamacpp_mtp"]
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            own = []  # what llama-server's own /tokenize says
            for text in TEXTS:
                r = await client.post(plain.server.base_url + "/tokenize",
                                      json={"content": text, "add_special": True,
                                            "parse_special": True})
                own.append(r.json()["tokens"])
        assert len(own[2]) < len(TEXTS[2]) // 2  # the special tokens are single tokens
        before = await answers(plain)
        assert before[0] == own
        with frozen(plain.server.pid):
            # One call waits out the hung process (2 s); the rest ask the
            # sibling first (before the fix, each call hung for read_timeout).
            # (Bounded at 5 waits: asked first every time, its 7 calls took 7.)
            after = await asyncio.wait_for(answers(plain), 5 * llamacpp_engine.QUICK_TIMEOUT_S)
            assert after == before
            assert plain.server.unanswered_at is not None
            assert await mtp.encode(TEXTS[1]) == own[1]
            with frozen(mtp.server.pid):  # no process answers: a clear error, in bounded time
                with pytest.raises(EngineError) as e:
                    await plain.encode("hello")
        msg = str(e.value)
        assert "demo-gguf" in msg and "the plain process: no answer within" in msg, msg
        assert "the draft-mtp process: no answer within" in msg, msg

    run_engines(engines, body, timeout=120)


# -- through the gateway -------------------------------------------------------------


def recovered(readiness: list[httpx.Response]) -> bool:
    """/ready said not ready, and ready again since."""
    codes = [r.status_code for r in list(readiness)]
    return 503 in codes and 200 in codes[codes.index(503):]


def test_gateway_serves_a_model_whose_plain_process_hangs(llama_server_binary, tmp_path):
    gw = start_gateway(
        {"llama_server": {"binary": str(llama_server_binary)},
         "models": [{"id": "demo-gguf", "path": "builtin:demo-gguf",
                     "engines": ["llamacpp", "llamacpp_mtp"], "max_concurrent": 2,
                     "max_context": 1024,
                     "llamacpp": {"threads": 1, "health_interval_s": FAST.interval,
                                  "health_timeout_s": FAST.timeout,
                                  "health_failures": FAST.failures}}]},
        tmp_path,
    )
    pids = llama_servers(gw.process.pid)
    try:
        client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Write a function that sorts a list."}]

        def chat():
            return client.chat.completions.create(model="demo-gguf", messages=msgs,
                                                  max_tokens=8, temperature=0)

        reference = chat()
        plain = next(pid for k, pid in pids.items() if k.endswith(":plain"))
        readiness: list[httpx.Response] = []
        watching = threading.Event()

        def watch_ready():
            while not watching.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    readiness.append(httpx.get(gw.base_url + "/ready", timeout=5))

        watcher = threading.Thread(target=watch_ready)
        with frozen(plain):
            watcher.start()
            try:
                # Tokenized by the draft-mtp process, decoded there: served as before.
                r = chat()
                assert r.choices[0].message.content == reference.choices[0].message.content
                assert r.usage.prompt_tokens == reference.usage.prompt_tokens
                deadline = time.monotonic() + 60
                while not recovered(readiness):
                    assert time.monotonic() < deadline, "the hung process was not replaced"
                    time.sleep(0.1)
            finally:
                watching.set()
                watcher.join()
        unready = [r.json() for r in readiness if r.status_code == 503]
        assert unready, "/ready never said the model had a problem"
        assert "did not answer /health" in unready[0]["errors"]["demo-gguf"]
        # The restarted plain process serves.
        r = client.completions.create(model="demo-gguf", prompt="def main():", max_tokens=8,
                                      temperature=0, extra_headers={"X-Specgate-Method": "none"})
        assert r.usage.completion_tokens == 8
        now = llama_servers(gw.process.pid)
        assert len(now) == 2 and plain not in now.values()
        pids |= {f"{k}:again": v for k, v in now.items()}
    finally:
        stop_gateway(gw)
    assert "Traceback" not in gw.log()
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids.values()):
        assert time.monotonic() < deadline, "a llama-server outlived the gateway"
        time.sleep(0.1)
