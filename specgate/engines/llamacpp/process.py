"""One managed `llama-server` process per GGUF model.

specgate starts llama-server on a loopback port it picks itself (--port 0:
no other process can take the port between a choice and the bind, and a
health check can never reach another server there) and learns the port
from the `listening on` line it logs; then it waits for /health,
notices when it dies or hangs, restarts it with backoff, stops it when idle
(optional TTL) and never leaves it behind: the child runs in its own process
group, and on Linux the kernel SIGKILLs it when the gateway dies
(PR_SET_PDEATHSIG), even when the gateway itself is SIGKILLed and no Python
cleanup runs.

A hung process (SIGSTOPped, wedged in the kernel, swapped to death) keeps its
listening socket: connections are accepted and then nothing answers. So while
it runs, GET /health is asked every `health_interval` seconds. One answer
missed (none within `health_timeout`) is a `problem` at once, so /ready says
so within seconds; the next answer clears it. A process that misses
`health_failures` answers in a row is declared stuck and SIGKILLed (the one
signal a stopped process cannot hold back), which also fails the requests in
flight on it at once, and restarted.
llama-server answers /health from its HTTP threads, not from the loop that
decodes, so a long prompt or a slow token does not make a process look stuck.
While a process is stuck, dead or restarting, `problem` says why.

macOS has no parent-death signal: there (and on Linux too) llama-server is
started through lifeline.py, whose watcher stops it once a pipe only the
gateway holds reaches EOF, which a gateway's death of any kind causes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specgate.engines.home import logs_dir
from specgate.engines.llamacpp.binary import find_llama_server

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the only address llama-server is ever bound to: it has no auth of its own
_POLL_S = 0.2


class LlamaServerError(RuntimeError):
    """llama-server could not be started (the message carries its log tail)."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code  # the process's returncode when it exited (< 0: a signal)


# A crash while loading (a signal, not an error exit) is most often one of
# ggml's CPU "extra buffer" paths: it repacks quantized weights into layouts
# for the CPU's own kernels (AMX, AVX-512 VNNI, ARM's i8mm) at load and warm-up,
# and on some CPUs that path segfaults for some types (Q4_1 on AMX machines).
# --no-repack keeps the weights as the file has them: the plain kernels, a
# little slower prompt processing, the same outputs.
SAFE_FLAG = "--no-repack"
_SAFE_FLAG_SPELLINGS = ("--no-repack", "-nr", "--repack")  # the user already chose
SAFE_FLAG_WHY = ("which keeps the weights in the file's layout instead of repacking them for "
                 "this CPU's kernels (ggml's repack path crashes on some CPUs, e.g. Q4_1 on AMX); "
                 "prompt processing may be a little slower")  # fmt: skip
# The models (GGUF paths) whose llama-server crashed while loading and then
# started with SAFE_FLAG, with why: their later starts, the model's other
# processes and a reload in this gateway get SAFE_FLAG from the first try.
_NEEDS_SAFE_FLAG: dict[Path, str] = {}


# The speculation types specgate runs llama-server with, and the flags that
# set the most tokens a round drafts (each type has its own; ngram-mod's
# least draft is set to 1 so that it proposes what it has). The lookup key's
# length of the n-gram types is SPEC_LOOKUP_FLAGS's (ServerSpec.spec's
# "lookup"); their other knobs (min hits) keep llama.cpp's defaults and can be
# set through extra_args.
SPEC_TYPES: dict[str, tuple[str, ...]] = {
    "draft-mtp": ("--spec-draft-n-max",),
    "ngram-simple": ("--spec-ngram-simple-size-m",),
    "ngram-map-k": ("--spec-ngram-map-k-size-m",),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-m",),
    "ngram-mod": ("--spec-ngram-mod-n-max", "--spec-ngram-mod-n-min"),
}
NGRAM_TYPES = tuple(t for t in SPEC_TYPES if t.startswith("ngram"))
# The flag that sets how many tokens of context an n-gram type matches before
# it copies what followed (llama.cpp's defaults: 12 for the -size-n ones, 24
# for ngram-mod's n-match: long keys that rarely match in a short context).
SPEC_LOOKUP_FLAGS: dict[str, str] = {
    "ngram-simple": "--spec-ngram-simple-size-n",
    "ngram-map-k": "--spec-ngram-map-k-size-n",
    "ngram-map-k4v": "--spec-ngram-map-k4v-size-n",
    "ngram-mod": "--spec-ngram-mod-n-match",
}

# What llama-server logs (at info) once it listens and its model is loaded:
# the port it bound to --port 0.
_LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")
# Flags (and llama.cpp's environment variable) that would hide that line.
_QUIET_FLAGS = ("--log-disable",)
_VERBOSITY_FLAGS = ("-lv", "--verbosity", "--log-verbosity")
_VERBOSITY_ENV = "LLAMA_ARG_LOG_VERBOSITY"
_INFO = 3  # llama.cpp's verbosity of info lines


@dataclass
class ServerSpec:
    """How to run llama-server for one GGUF model."""

    model: Path
    ctx_size: int = 4096
    parallel: int = 1  # slots (-np)
    threads: int = field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    # None or {"type": one of SPEC_TYPES, "n_max": int, "lookup": int (n-gram types, optional)}
    spec: dict | None = None
    extra_args: list[str] = field(default_factory=list)
    draft_model: Path | None = None  # draft-mtp's separate drafter GGUF (-md): Gemma-4's assistant
    chat_template_file: Path | None = None  # --chat-template-file: the model config's chat_template
    # --cache-type-k/-v: the model's kv_bits as llama.cpp's block types (None: f16)
    cache_type: str | None = None
    no_repack: bool = False  # SAFE_FLAG: set after a crash while loading (LlamaServer)

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.spec is not None:
            if self.spec.get("type") not in SPEC_TYPES:
                raise ValueError(f"spec type must be one of {', '.join(SPEC_TYPES)}, "
                                 f"not {self.spec.get('type')!r}")
            if int(self.spec.get("n_max", 0)) < 1:
                raise ValueError(f"spec n_max must be >= 1, got {self.spec.get('n_max')!r}")
        for flag in ("--host", "--port"):
            # The bind address is not the user's to change: llama-server has no auth.
            if flag in self.extra_args:
                raise ValueError(f"{flag} is set by specgate and cannot be passed in extra_args")
        for i, flag in enumerate(self.extra_args):
            value = self.extra_args[i + 1] if i + 1 < len(self.extra_args) else ""
            if flag in _QUIET_FLAGS or (flag in _VERBOSITY_FLAGS and not _verbose(value)):
                raise ValueError(f"{flag} {value if flag in _VERBOSITY_FLAGS else ''}".rstrip()
                                 + " would hide llama-server's `listening on` line, which tells "
                                 "specgate its port; it cannot be passed in extra_args")  # fmt: skip

    def args(self, port: int) -> list[str]:
        argv = [
            "-m", str(self.model), "--host", HOST, "--port", str(port), "--metrics", "--slots",
            "-c", str(self.ctx_size), "-np", str(self.parallel), "-t", str(self.threads),
        ]
        if self.spec is not None:
            kind, n_max = self.spec["type"], str(int(self.spec["n_max"]))
            argv += ["--spec-type", kind]
            for flag in SPEC_TYPES[kind]:
                argv += [flag, "1" if flag.endswith("-n-min") else n_max]
            if self.spec.get("lookup") and kind in SPEC_LOOKUP_FLAGS:
                argv += [SPEC_LOOKUP_FLAGS[kind], str(int(self.spec["lookup"]))]
        if self.draft_model is not None:
            argv += ["-md", str(self.draft_model)]
        if self.chat_template_file is not None:
            argv += ["--chat-template-file", str(self.chat_template_file)]
        if self.cache_type is not None:
            # A quantized V cache needs flash attention, which llama-server's
            # default (auto) turns on wherever it runs.
            argv += ["--cache-type-k", self.cache_type, "--cache-type-v", self.cache_type]
        if self.no_repack and not self.chose_repack:
            argv.append(SAFE_FLAG)
        return argv + list(self.extra_args)

    @property
    def chose_repack(self) -> bool:
        """extra_args already say whether to repack: specgate leaves that alone."""
        return any(a in _SAFE_FLAG_SPELLINGS for a in self.extra_args)


def _verbose(value: str | None) -> bool:
    """Whether a llama.cpp verbosity shows info lines (unset: yes)."""
    try:
        return value is None or int(value) >= _INFO
    except ValueError:
        return False


# --- never leave a llama-server behind ------------------------------------

# Loaded in the parent so the forked child only calls a function pointer
# between fork and exec (no dlopen, no imports in that fragile window).
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _child_setup(parent_pid: int) -> None:
    """preexec_fn: ask the kernel to SIGKILL this child when its parent dies.

    This is what cleans up after a SIGKILLed gateway, where no Python code
    (atexit, finally, signal handlers) gets to run. The signal follows the
    *thread* that forked, so LlamaServer starts processes from the event-loop
    thread, never from a short-lived worker thread. It survives exec.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died before prctl ran: then nobody would ever kill us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


LIFELINE = Path(__file__).with_name("lifeline.py")

_LIVE: weakref.WeakSet[LlamaServer] = weakref.WeakSet()


@atexit.register
def _kill_all_at_exit() -> None:
    """On a normal interpreter exit, kill every group we started (the macOS safety net)."""
    for server in list(_LIVE):
        server._kill_group(signal.SIGKILL)


_SERVERS = itertools.count(1)  # numbers each LlamaServer's log file in this process


class LlamaServer:
    """A managed llama-server for one model, on a 127.0.0.1 port it picks
    (a new one at each start).

    `restarts` counts starts that replaced a process which had died on its
    own (crash recovery); a stop by stop() or the idle TTL is not a crash,
    so starting again after it does not count.
    """

    def __init__(
        self,
        spec: ServerSpec,
        *,
        binary: str | Path | None = None,
        ttl: float | None = None,
        start_timeout: float = 120.0,
        stop_grace: float = 10.0,
        max_start_failures: int = 5,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        health_interval: float = 1.0,
        health_timeout: float = 2.0,
        health_failures: int = 3,
    ) -> None:
        self.spec = spec
        self._binary = binary
        self.ttl = ttl
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.max_start_failures = max_start_failures
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_failures = health_failures

        self.port: int | None = None  # the running process's, from its log
        # Its own file (this process, this server): the `listening on` line
        # read at a start can only be that start's process's.
        name = f"llama-server-{spec.model.stem}-{os.getpid()}-{next(_SERVERS)}.log"
        self.log_path = logs_dir() / name
        self.restarts = 0
        self.starts = 0
        self.last_exit_code: int | None = None  # returncode of the last unexpected exit
        # Why it runs with SAFE_FLAG, once a crash while loading made it (None: it does not).
        self.fallback: str | None = _NEEDS_SAFE_FLAG.get(self._model_key())
        if self.fallback is not None:
            spec.no_repack = True
        # When a quick request (a tokenization) last went unanswered, as its
        # caller saw it: it asks other processes first for a while (engine.py).
        self.unanswered_at: float | None = None
        self._proc: subprocess.Popen | None = None
        self._lifeline: int | None = None  # the pipe's write end: see lifeline.py
        self._healthy: subprocess.Popen | None = None  # _proc once it answered /health at start
        self._crashed = False  # the last process died without being asked to
        self._problem: str | None = None  # why it cannot serve now (stuck, died, restarting)
        self._death: str | None = None  # how the last process that died on its own ended
        self._dead: subprocess.Popen | None = None  # ... and which process that was
        self._failures = 0  # consecutive failed starts
        self._retry_at = 0.0  # monotonic time before which ensure_running waits to retry
        self._last_used = time.monotonic()
        self._in_use = 0
        self._monitor: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None  # restarting a dead or stuck process
        self._lock = asyncio.Lock()

    # --- state --------------------------------------------------------------

    def _model_key(self) -> Path:
        return self.spec.model.resolve()

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise LlamaServerError("llama-server has not been started")
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def running(self) -> bool:
        """Alive and started: it answered /health (a process still starting is alive, not running)."""
        return self.alive and self._healthy is self._proc

    @property
    def problem(self) -> str | None:
        """Why this server cannot serve now (stuck, died, restarting), or None.

        None too while it is merely not started (start: first_use, or stopped
        by the idle TTL): the next request starts it.
        """
        return self._problem

    @property
    def death(self) -> str | None:
        """How the last process that ended without being asked to ended, if one did."""
        proc = self._proc
        if proc is not None and proc is not self._dead and proc.poll() is not None:
            return f"the process exited (code {proc.returncode})"  # not yet seen by _watch
        return self._death

    @property
    def exit_code(self) -> int | None:
        """The exit code of the last process that died on its own, if one did."""
        if self._proc is not None and self._proc.poll() is not None:
            return self._proc.returncode
        return self.last_exit_code

    @property
    def command(self) -> list[str]:
        return [str(find_llama_server(self._binary_str())), *self.spec.args(0)]

    def _binary_str(self) -> str | None:
        return str(self._binary) if self._binary is not None else None

    def log_tail(self, n: int = 40) -> str:
        """The last n lines llama-server wrote (stdout and stderr)."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def touch(self) -> None:
        """Mark the server as used now (pushes back the idle TTL)."""
        self._last_used = time.monotonic()

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[str]:
        """Hold the server for one request: running, and not stopped by the TTL meanwhile."""
        await self.ensure_running()
        self._in_use += 1
        self.touch()
        try:
            yield self.base_url
        finally:
            self._in_use -= 1
            self.touch()

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start llama-server and wait until GET /health answers 200."""
        async with self._lock:
            await self._start_locked()

    async def ensure_running(self) -> None:
        """Start it if it is not running (after a crash or an idle stop).

        Consecutive failed starts back off exponentially (backoff_initial
        doubling up to backoff_max, reset by a healthy start), also across
        calls, so a broken model is not respawned at request rate. One call
        gives up with a clear error after max_start_failures attempts.
        """
        self.touch()
        if self.running:
            return
        async with self._lock:
            attempts = 0
            while not self.running:
                wait = self._retry_at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    await self._start_locked()
                except LlamaServerError as e:
                    attempts += 1
                    if attempts >= self.max_start_failures:
                        raise LlamaServerError(
                            f"llama-server for {self.spec.model} failed to start "
                            f"{self._failures} times in a row; giving up. Last error: {e}"
                        ) from e
                    log.warning("llama-server start failed; retrying in %.1f s: %s",
                                self._retry_at - time.monotonic(), e)

    async def stop(self, grace: float | None = None) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds (at
        most, and by default, `stop_grace`). Idempotent."""
        await self._cancel_recovery()
        grace = self.stop_grace if grace is None else min(grace, self.stop_grace)
        async with self._lock:
            await self._stop_locked(grace)
        # The watcher may have seen a crash, and begun a restart, just before
        # _stop_locked ended it.
        await self._cancel_recovery()
        self._problem = self._death = self._dead = None

    async def _cancel_recovery(self) -> None:
        recovery, self._recovery = self._recovery, None
        if recovery is not None:
            recovery.cancel()  # a restart under way kills what it started (_start_locked)
            with contextlib.suppress(asyncio.CancelledError):
                await recovery

    async def _start_locked(self) -> None:
        if self.running:
            return
        if self._proc is not None and self._proc.poll() is not None:
            # stop() clears _proc, so a dead one still here died on its own,
            # whether or not the watcher has seen it yet.
            self._crashed = True
            self.last_exit_code = self._proc.returncode
        await self._stop_locked()  # reap the dead one (or a half-started one), end its monitor
        binary = find_llama_server(self._binary_str())
        argv = [str(binary), *self.spec.args(0)]  # it binds a port of its own, and says which
        env = dict(os.environ)
        if not _verbose(env.get(_VERBOSITY_ENV)):
            del env[_VERBOSITY_ENV]  # it would hide the line that says the port
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_lifeline()
        read_end, self._lifeline = os.pipe()  # the write end stays here, never inherited
        with open(self.log_path, "ab") as out:
            out.write(f"\n--- specgate: starting {' '.join(argv)}\n".encode())
            out.flush()
            this_start = out.tell()  # the `listening on` line is read from here
            try:
                self._proc = subprocess.Popen(
                    # lifeline.py execs llama-server in its own place: _proc is llama-server.
                    [sys.executable, "-I", str(LIFELINE), str(read_end), *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # own process group: stop() signals the whole group
                    preexec_fn=functools.partial(_child_setup, os.getpid()),
                    pass_fds=(read_end,),
                )
            finally:
                os.close(read_end)
        _LIVE.add(self)
        self.starts += 1
        try:
            await self._wait_healthy(this_start)
        except LlamaServerError as e:
            await self._stop_locked()
            if self._retry_safely(e):
                return await self._start_locked()  # once: SAFE_FLAG is set now
            self._failures += 1
            delay = self.backoff_initial * 2 ** (self._failures - 1)
            self._retry_at = time.monotonic() + min(self.backoff_max, delay)
            raise
        except BaseException:
            await self._stop_locked()  # e.g. cancelled: leave no half-started process
            raise
        if self._crashed:
            self.restarts += 1
        self._crashed = False
        self._failures = 0
        self._healthy = self._proc
        self._problem = self.unanswered_at = None
        self.touch()
        self._monitor = asyncio.create_task(self._watch(self._proc))
        log.info("llama-server for %s ready at %s (pid %d, log %s)", self.spec.model,
                 self.base_url, self._proc.pid, self.log_path)

    def _retry_safely(self, e: LlamaServerError) -> bool:
        """After a crash (a signal) while loading, start again at once with
        SAFE_FLAG, and keep it for this model's later starts: True when that
        is to be tried (once: never when it is set already, or when the
        config's extra_args chose repacking or not)."""
        if e.exit_code is None or e.exit_code >= 0 or self.spec.no_repack or self.spec.chose_repack:
            return False
        try:
            name = signal.Signals(-e.exit_code).name
        except ValueError:
            name = f"signal {-e.exit_code}"
        self.fallback = (f"llama-server crashed while loading ({name}); retried with {SAFE_FLAG}, "
                         f"{SAFE_FLAG_WHY}")  # fmt: skip
        self.spec.no_repack = True
        _NEEDS_SAFE_FLAG[self._model_key()] = self.fallback
        log.warning("model file %s: %s; log %s", self.spec.model, self.fallback, self.log_path)
        return True

    async def _wait_healthy(self, log_from: int) -> None:
        """Until the process says where it listens (its log, from `log_from`:
        it binds before loading the model, says so after) and answers /health
        there. `port` changes only then: until the new process runs, base_url
        stays the last one's, which fails as a dead process does."""
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        port = None
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise LlamaServerError(
                        f"llama-server for {self.spec.model} exited with code {code} while "
                        f"starting; log {self.log_path}:\n{self.log_tail()}", exit_code=code
                    )
                if port is None:
                    port = self._listening_port(log_from)
                try:
                    if port is not None:
                        r = await client.get(f"http://{HOST}:{port}/health")
                        if r.status_code == 200:
                            self.port = port
                            return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise LlamaServerError(
                        f"llama-server for {self.spec.model} not healthy after "
                        f"{self.start_timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
                    )
                await asyncio.sleep(_POLL_S)

    def _listening_port(self, log_from: int) -> int | None:
        """The port in the `listening on` line logged since `log_from`, if any yet."""
        with open(self.log_path, "rb") as f:
            f.seek(log_from)
            m = _LISTENING.search(f.read())
        return int(m.group(1)) if m else None

    async def _stop_locked(self, grace: float | None = None) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None and monitor is not asyncio.current_task():
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._kill_group(signal.SIGTERM)
            deadline = time.monotonic() + (self.stop_grace if grace is None else grace)
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self._kill_group(signal.SIGKILL)  # no-op when SIGTERM did it
        proc.wait()
        self._cut_lifeline()
        self._proc = self._healthy = None
        _LIVE.discard(self)

    def _cut_lifeline(self) -> None:
        """Close our end of the lifeline: the watcher of a process that has
        ended leaves (lifeline.py)."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def _kill_group(self, sig: int) -> None:
        proc = self._proc
        # Only while the leader is unreaped: its pid (= the group id) cannot be
        # reused until then, so the signal can never reach a stranger's group.
        # llama-server forks no children, so the leader is the whole group.
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already empty

    async def _watch(self, proc: subprocess.Popen) -> None:
        """Notice an unexpected exit or a hang, and stop the server after `ttl` seconds idle."""
        misses = 0
        next_check = time.monotonic() + self.health_interval
        async with httpx.AsyncClient(trust_env=False, timeout=self.health_timeout) as client:
            while True:
                await asyncio.sleep(_POLL_S)
                code = proc.poll()
                if code is not None:
                    self._died(proc, f"the process exited unexpectedly (code {code})")
                    log.warning("llama-server for %s exited unexpectedly (code %s); log tail:\n%s",
                                self.spec.model, code, self.log_tail(10))
                    return
                if time.monotonic() >= next_check:
                    misses = 0 if await self._answers_health(client) else misses + 1
                    next_check = time.monotonic() + self.health_interval
                    if misses >= self.health_failures:
                        await self._kill_stuck(proc, misses)
                        return
                    # One miss is a problem already (/ready says so); an
                    # answer ends it, and a few in a row end the process.
                    self._problem = None if not misses else (
                        f"the process (pid {proc.pid}) did not answer /health within "
                        f"{self.health_timeout:g} s ({misses} time{'s' * (misses > 1)} in a row; "
                        f"killed at {self.health_failures})")  # fmt: skip
                idle = time.monotonic() - self._last_used
                if self.ttl is not None and self._in_use == 0 and idle >= self.ttl:
                    log.info("llama-server for %s idle %.0f s: stopping", self.spec.model, idle)
                    async with self._lock:
                        if self._proc is proc:
                            await self._stop_locked()
                    return

    async def _answers_health(self, client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(self.base_url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _kill_stuck(self, proc: subprocess.Popen, misses: int) -> None:
        why = (f"the process (pid {proc.pid}) did not answer /health {misses} times in a row "
               f"({self.health_timeout:g} s each): it was stuck, so it was killed")
        log.warning("llama-server for %s: %s; restarting", self.spec.model, why)
        # Said before the kill, so the requests it fails (at once: their
        # connections close) can tell their clients why.
        self._dead, self._death, self._problem = proc, why, f"{why}; restarting"
        self._kill_group(signal.SIGKILL)  # the one signal a stopped process cannot hold back
        while proc.poll() is None:  # brief: SIGKILL needs no cooperation
            await asyncio.sleep(0.01)
        self._died(proc, why)

    def _died(self, proc: subprocess.Popen, why: str) -> None:
        """The process ended without being asked to: say so, and restart it."""
        self._crashed = True
        self._cut_lifeline()
        self.last_exit_code = proc.returncode
        self._dead, self._death, self._problem = proc, why, f"{why}; restarting"
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.create_task(self._recover())

    async def _recover(self) -> None:
        """Restart until it runs: /ready reports `problem` meanwhile, so waiting
        for the next request to restart it could wait forever."""
        while not self.running:
            try:
                await self.ensure_running()  # backs off between attempts, also across calls
            except Exception as e:  # a restart that fails is retried, never lost
                self._problem = f"{self._death}; restarting it fails: {e}"
                log.warning("llama-server for %s: %s", self.spec.model, self._problem)
                if not isinstance(e, LlamaServerError):  # no backoff was set (e.g. binary gone)
                    await asyncio.sleep(self.backoff_max)
