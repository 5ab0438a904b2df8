"""A model's CUDA kernels built side by side in worker processes, before the
proofs and the first forwards call them.

Why: on CUDA, MLX builds each kernel at its first call with NVRTC, one at
a time in a process: threads do not help (bench/proof_cost.py: 44.8 s on 8
threads against 51.9 s on one). Its own quantized matmul from 8 rows up is
a CUTLASS tile per row range and precision, ~27 s each on an H100: the
float32 and bfloat16 references the plain engine's proofs compare with at
9-16 rows made most of their 225 s, and a 4-bit model's prompt tiles most
of a fresh machine's ~50 s first prompt.

MLX reads a kernel back from MLX_PTX_CACHE_DIR before building it
(mlx/backend/cuda/jit_module.cpp: <module>.ptx, then <module>.txt), so
other processes can build for it. Each worker (`python -m
specgate.kernels.prebuild SHARED`) builds one job at a time into a private
directory and then moves what it built into the shared one, the .ptx last
(os.replace: a reader never finds half a module). Before each job it links
in what the others finished, and jobs likely to build the same modules
(Job.group) run one at a time, so a module is built once.

MLX reads a custom kernel (ours, mx.fast.cuda_kernel) from that cache but
never writes one there: a worker compiles ours itself instead (Job kind
"ours", kernels/nvrtc.py) and writes it into the shared cache. NVRTC
compiles one program at a time in a process, so processes, not threads.
Opportunistic: a call the workers have not
reached is built by the process itself, as without them, and a worker that
fails or dies costs nothing but speed. One stuck past JOB_TIMEOUT_S, or
none that can start, is killed, logged once, and the builder is off for
the process: its queued jobs fail at once, built where they are called.
Used only where MLX's backend is CUDA
(engines/kernel_wiring.py): Metal compiles in milliseconds and a CPU builds
none of these.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specgate.kernels import nvrtc

log = logging.getLogger("specgate.kernels")

JOB_TIMEOUT_S = 300.0  # one job; MLX's slowest CUTLASS tile took ~27 s on an H100
IDLE_S = 5.0  # a worker with nothing to do exits after this long
MAX_WORKERS = 8
_worker_seq = itertools.count(1)


@dataclass(frozen=True)
class Job:
    """One call to build at `shape`, the guard op's shape with its dtype as
    a name (QMM: M, K, N, dtype, bits, group size; FUSED_QMM: N a tuple):
    `kernel` "stock" (the op as MLX runs it: a forward's) or "reference"
    (that and the float32 product a proof compares with), built by MLX; or
    "ours": one of our kernels' `launch`, compiled for `arch` by
    kernels/nvrtc.py into the shared cache (MLX never writes ours there)."""

    op: str
    kernel: str
    shape: tuple
    launch: nvrtc.Launch | None = field(default=None, repr=False)
    arch: str = ""

    def line(self) -> str:
        d = {"op": self.op, "kernel": self.kernel, "shape": list(self.shape)}
        if self.launch is not None:
            d.update(launch=self.launch.to_dict(), arch=self.arch)
        return json.dumps(d)

    @property
    def group(self) -> tuple:
        """Jobs that likely build the same modules: one op at one row count
        and precision. MLX's kernels are templates over the row count's tile
        and the precision, not K and N. One job of a group builds at a
        time: the next then links in what it built instead of building the
        same module beside it (a first H100 run, without this, built each of
        MLX's prompt tiles on up to 8 workers at once). Ours: one module."""
        if self.launch is not None:
            return ("ours", self.launch.module_name)
        return (self.op, self.shape[0], *self.shape[3:])


@dataclass
class Report:
    """What one `Builder.build` call got done."""

    built: int = 0
    failed: int = 0
    known: int = 0  # built before by this process's workers (for another caller)
    cancelled: int = 0
    seconds: float = 0.0
    modules: int = 0  # modules the workers built (the rest of the jobs' were linked in)
    errors: list[str] = field(default_factory=list)
    slowest: list[tuple[float, Job]] = field(default_factory=list)  # (seconds, job), slowest first

    def note(self, seconds: float, job: Job) -> None:
        self.slowest = sorted([*self.slowest, (seconds, job)], key=lambda x: -x[0])[:5]


def default_workers() -> int:
    """Side by side builds: one core left to the process serving meanwhile."""
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))


class _Batch:
    def __init__(self, n: int):
        self.left = n
        self.report = Report()


class Builder:
    """Worker processes that build jobs into the MLX kernel cache `ptx_dir`,
    up to `workers` at once, started on demand and gone when idle."""

    def __init__(self, ptx_dir: Path, workers: int | None = None, *, job_timeout: float = JOB_TIMEOUT_S,
                 idle_s: float = IDLE_S, arch: str = ""):  # fmt: skip
        self.ptx_dir = Path(ptx_dir)
        self.arch = arch  # the GPU our kernels compile for ("sm_90"); "": they are not
        self.workers = default_workers() if workers is None else workers
        self.job_timeout, self.idle_s = job_timeout, idle_s
        self._cond = threading.Condition()
        self._queue: deque[tuple[Job, _Batch]] = deque()
        self._done: set[Job] = set()  # built (or failed) by a worker of this process
        self._built_groups: set[tuple] = set()  # the groups of the jobs built
        self._building: set[tuple] = set()  # the groups of the jobs workers are on
        self._threads = 0
        self._procs: set[subprocess.Popen] = set()
        self._closed = False

    def build(self, jobs: Iterable[Job], stop: threading.Event | None = None, *,
              urgent: bool = False) -> Report:  # fmt: skip
        """Build `jobs` (in order, side by side), returning once each is built
        or failed, or at once when `stop` is set: jobs no worker has taken
        are dropped (one taken finishes, and still lands in the cache).
        `urgent`: ahead of every job queued (a first speculative token waits
        for these), else behind them."""
        t0 = time.perf_counter()
        with self._cond:
            unique = list(dict.fromkeys(jobs))
            todo = [j for j in unique if j not in self._done]
            batch = _Batch(len(todo))
            batch.report.known = len(unique) - len(todo)
            if self._closed:
                batch.report.cancelled = len(todo)
                return batch.report
            items = [(j, batch) for j in todo]
            if urgent:
                self._queue.extendleft(reversed(items))
            else:
                self._queue.extend(items)
            # An urgent batch may start as many workers again: a first
            # speculative token should not wait for MLX's ~27 s prompt tiles
            # that the others are building.
            limit = self.workers * (2 if urgent else 1)
            while self._threads < min(limit, len(self._queue)):
                self._threads += 1
                seq = next(_worker_seq)  # (across builders: each worker's private directory its own)
                threading.Thread(target=self._work, args=(seq,), daemon=True,
                                 name=f"kernel-build-{seq}").start()  # fmt: skip
            self._cond.notify_all()
            while batch.left > 0:
                if stop is not None and stop.is_set():
                    kept = deque(item for item in self._queue if item[1] is not batch)
                    batch.report.cancelled = len(self._queue) - len(kept)
                    batch.left -= batch.report.cancelled
                    self._queue = kept
                    break
                self._cond.wait(0.1)
        batch.report.seconds = time.perf_counter() - t0
        return batch.report

    @property
    def done(self) -> set[Job]:
        """The jobs this process's workers built or failed."""
        with self._cond:
            return set(self._done)

    def built_groups(self) -> set[tuple]:
        """The groups (Job.group) of the jobs this process's workers built."""
        with self._cond:
            return set(self._built_groups)

    def close(self) -> None:
        """Kill the workers (a process exiting or an engine stopping)."""
        with self._cond:
            self._closed = True
            for _, batch in self._queue:  # (their callers return: nothing will build them)
                batch.left -= 1
                batch.report.cancelled += 1
            self._queue.clear()
            procs = list(self._procs)
            self._cond.notify_all()
        for p in procs:
            _kill(p)

    # ------------------------------------------------------------ workers
    def _take(self) -> tuple[Job, _Batch] | None:
        """The first queued job whose group no worker is building (None:
        idle for idle_s, or closed); a job built meanwhile is answered here."""
        with self._cond:
            deadline = time.monotonic() + self.idle_s
            while not self._closed:
                for i, (job, batch) in enumerate(self._queue):
                    if job in self._done:  # (queued twice by two callers: the first built it)
                        del self._queue[i]
                        batch.left -= 1
                        batch.report.known += 1
                        self._cond.notify_all()
                        break
                    if job.group not in self._building:
                        del self._queue[i]
                        self._building.add(job.group)
                        return job, batch
                else:
                    left = deadline - time.monotonic()
                    if not self._queue and left <= 0:
                        return None
                    self._cond.wait(max(0.05, left) if not self._queue else 0.5)
            return None

    def _finish(self, job: Job, batch: _Batch, ok: bool, why: str, seconds: float, modules: int) -> None:
        """(holding the condition)"""
        self._done.add(job)
        self._building.discard(job.group)
        batch.left -= 1
        r = batch.report
        if ok:
            r.built += 1
            self._built_groups.add(job.group)
        else:
            r.failed += 1
            r.errors.append(f"{job.kernel} {job.shape}: {why}")
        r.modules += modules
        r.note(seconds, job)
        self._cond.notify_all()

    def _work(self, seq: int) -> None:
        proc = None
        private = self.ptx_dir / f".build-{os.getpid()}-{seq}"
        item = None
        try:
            while True:
                item = self._take()
                if item is None:
                    return
                job, batch = item
                if proc is None or proc.poll() is not None:
                    proc = self._spawn(private)
                t = time.perf_counter()
                ok, why, modules = self._run(proc, job)
                if not ok and proc.poll() is None and why.startswith("timed out"):
                    # A build that hangs is a stuck compiler, not a slow one.
                    _kill(proc)
                    with self._cond:
                        self._procs.discard(proc)
                    raise _Stuck(f"{job.kernel} {job.shape}: {why}")
                with self._cond:
                    self._finish(job, batch, ok, why, time.perf_counter() - t, modules)
                item = None
        except Exception as e:  # noqa: BLE001 - a builder is an optimisation: it never takes a proof down
            # (a worker stuck past JOB_TIMEOUT_S, a cache directory it cannot
            # write, no Python to start): every queued job fails now, built
            # where it is called, and this process builds nothing side by
            # side from now on
            log.warning("kernel builds side by side are off: %s: %s", type(e).__name__, e)
            with self._cond:
                if item is not None:
                    self._finish(*item, False, f"worker failed: {e}", 0.0, 0)
                self._closed = True
                while self._queue:
                    job, batch = self._queue.popleft()
                    self._finish(job, batch, False, f"builder off: {e}", 0.0, 0)
        finally:
            with self._cond:
                self._threads -= 1
                self._cond.notify_all()
            if proc is not None:
                _stop(proc)
                with self._cond:
                    self._procs.discard(proc)
            shutil.rmtree(private, ignore_errors=True)

    def _spawn(self, private: Path) -> subprocess.Popen:
        private.mkdir(parents=True, exist_ok=True)
        # (this process's import path: specgate is found where it was found here)
        path = os.pathsep.join(p for p in sys.path if p)
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(private), PYTHONUNBUFFERED="1", PYTHONPATH=path)
        proc = subprocess.Popen([sys.executable, "-m", "specgate.kernels.prebuild", str(self.ptx_dir)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=env, text=True)  # fmt: skip
        with self._cond:
            self._procs.add(proc)
            if self._closed:
                _kill(proc)
        return proc

    def _run(self, proc: subprocess.Popen, job: Job) -> tuple[bool, str, int]:
        """Hand `job` to `proc` and read its answer: (built, why not, modules built)."""
        try:
            proc.stdin.write(job.line() + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            return False, f"worker gone ({type(e).__name__})", 0
        ready, _, _ = select.select([proc.stdout], [], [], self.job_timeout)
        if not ready:
            return False, f"timed out after {self.job_timeout:.0f} s", 0
        line = proc.stdout.readline()
        if not line:
            return False, f"worker exited ({proc.poll()})", 0
        try:
            answer = json.loads(line)
        except ValueError:
            return False, f"unreadable answer {line[:80]!r}", 0
        return bool(answer.get("ok")), str(answer.get("error", "")), int(answer.get("built", 0))


class _Stuck(RuntimeError):
    """A worker that did not answer within JOB_TIMEOUT_S (killed)."""


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------- the cache's files


def hand_over(private: Path, shared: Path, seen: set[str]) -> list[str]:
    """Move each module built in `private` (not `seen`: linked in from
    `shared`) into `shared`, its other files before its .ptx (MLX takes a
    module to be there once its .ptx is), each by os.replace (atomic on one
    filesystem); each moved is seen from then on. Returns those moved."""
    moved = []
    for ptx in sorted(private.glob("*.ptx")):
        stem = ptx.name[: -len(".ptx")]
        if stem in seen:
            continue
        for suffix in _OTHERS:
            if (private / (stem + suffix)).exists():
                os.replace(private / (stem + suffix), shared / (stem + suffix))
        os.replace(ptx, shared / ptx.name)
        seen.add(stem)
        moved.append(stem)
    return moved


def take_in(shared: Path, private: Path, seen: set[str]) -> int:
    """Link into `private` the modules in `shared` not `seen` (linked
    before, or built here and handed over: in this process's memory), the
    .ptx last: MLX reads only its own cache directory. Returns the modules
    linked."""
    linked = 0
    for ptx in shared.glob("*.ptx"):
        stem = ptx.name[: -len(".ptx")]
        if stem in seen or (private / ptx.name).exists():
            continue
        try:
            for suffix in (*_OTHERS, ".ptx"):
                if (shared / (stem + suffix)).exists() and not (private / (stem + suffix)).exists():
                    _link(shared / (stem + suffix), private / (stem + suffix))
        except OSError:
            continue  # (gone meanwhile: built here if needed)
        seen.add(stem)
        linked += 1
    return linked


_OTHERS = (".txt", ".cu")  # what MLX writes beside a module's .ptx


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # (a filesystem without hard links: a copy is as good)
        shutil.copyfile(src, dst)


# ---------------------------------------------------------------- the worker process


def _build(job: dict, shared: Path) -> int:
    """Make the calls a proof (or a forward) makes first at the job's
    shape; or compile our kernel's launch into `shared` (returns 1 where it
    was compiled here)."""
    if job["kernel"] == "ours":
        compiler = nvrtc.nvrtc()
        if compiler is None:
            raise RuntimeError(f"no NVRTC: {nvrtc.unavailable()}")
        return int(nvrtc.seed(compiler, shared, nvrtc.Launch.from_dict(job["launch"]), job["arch"]))
    import mlx.core as mx

    from specgate.kernels import guard

    ops = {"qmm": guard.QMM, "qmm_fused": guard.FUSED_QMM}
    op = ops[job["op"]]
    shape = [tuple(s) if isinstance(s, list) else s for s in job["shape"]]
    shape = [getattr(mx, s) if isinstance(s, str) else s for s in shape]
    if job["kernel"] not in ("stock", "reference"):
        raise ValueError(f"unknown job kind {job['kernel']!r}: stock, reference or ours")
    args = op.inputs(0, *shape)
    outs = [op.joined(op.stock(*args))]
    if job["kernel"] == "reference":
        outs.append(op.exact(*args))
    mx.eval(outs)
    return 0


def main(argv: list[str]) -> int:
    """Read one job per line on stdin, build it, move what was built into
    the shared cache (argv[0]), answer one JSON line; exit at EOF."""
    shared = Path(argv[0])
    private = Path(os.environ["MLX_PTX_CACHE_DIR"])
    # MLX is imported by the first job that asks MLX to build (`_build`): a
    # worker compiling only ours never loads it, nor starts CUDA (a context
    # and its memory on the GPU), a second or so of each urgent worker's
    # start on a fresh machine's way to its first speculative token.
    seen: set[str] = set()  # modules in both caches (linked in, or built and handed over)
    for line in sys.stdin:
        t0 = time.perf_counter()
        answer: dict = {"ok": True}
        ours = 0
        try:
            take_in(shared, private, seen)
            ours = _build(json.loads(line), shared)
        except Exception as e:  # noqa: BLE001 - reported; the proof builds it itself
            answer = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
        try:
            answer["built"] = ours + len(hand_over(private, shared, seen))
        except OSError as e:
            answer = {"ok": False, "error": f"hand over: {e}"}
        if (mx := sys.modules.get("mlx.core")) is not None:
            mx.clear_cache()
        answer["s"] = round(time.perf_counter() - t0, 3)
        answer["pid"] = os.getpid()
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
