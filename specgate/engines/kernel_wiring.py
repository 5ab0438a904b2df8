"""kernels/wiring.py as the engines (and `specgate tune`) call it: the shared
guards keep their verdicts in $SPECGATE_HOME/kernels (engines/home.py),
read at each call, since kernels/ sits below the engines and reads no
environment for it. Where MLX builds kernels with NVRTC (CUDA), what the
proofs and a model's first prompts would build one at a time is built side
by side first, by this process's worker processes (kernels/prebuild.py)."""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref

import mlx.core as mx

from specgate.engines.home import kernel_cache_dir, mlx_ptx_dir
from specgate.kernels import hook, wiring
from specgate.kernels.guard import Guard
from specgate.kernels.prebuild import Builder, default_workers
from specgate.kernels.tiles import TileWatch
from specgate.kernels.wiring import SETTINGS, Wiring, describe, model_shapes

log = logging.getLogger(__name__)

# Worker processes that build kernels side by side (None: one core left
# free, up to prebuild.MAX_WORKERS; 0: none, each built where first called).
build_workers: int | None = None
_builder: Builder | None = None
_builder_lock = threading.Lock()
# Per builder, each prompt-tile job handed to it, (op, shape), with the
# event its batch sets when done: a second module with some of the same
# shapes (an MTP head beside its trunk) watches those builds, not new ones.
_prompt_jobs: weakref.WeakKeyDictionary[Builder, dict[tuple, threading.Event]] = weakref.WeakKeyDictionary()


def builder() -> Builder | None:
    """This process's kernel builders, where MLX's backend is CUDA (and
    `build_workers` is not 0); None elsewhere."""
    global _builder
    workers = default_workers() if build_workers is None else build_workers
    if workers <= 0 or not mx.cuda.is_available() or mx.default_device() != mx.gpu:
        return None
    with _builder_lock:
        if _builder is None:
            arch = str(mx.device_info().get("architecture", ""))
            _builder = Builder(mlx_ptx_dir(mx.__version__), workers, arch=arch if arch.startswith("sm_") else "")
            atexit.register(_builder.close)  # (its workers would end at their stdin's EOF, after a build)
        _builder.workers = workers
        return _builder


def prebuild_forward(model) -> threading.Thread | None:
    """MLX's own quantized matmuls at `model`'s prompt-chunk shapes, built
    side by side in the background (wiring.forward_jobs); meanwhile a
    product whose tile is not built yet is computed without it
    (kernels/tiles.py), so no prompt waits for a build. Shapes another
    module's call queued already are not queued again. None where there is
    no builder or nothing new to build."""
    b = builder()
    every = wiring.forward_jobs(model) if b is not None else []
    if not every:
        return None
    finished = threading.Event()
    with _builder_lock:
        queued = _prompt_jobs.setdefault(b, {})
        batches = [queued.setdefault((j.op, j.shape), finished) for j in every]
    hook.watch_tiles(model, TileWatch(b.built_groups, list({id(e): e for e in batches}.values())))
    jobs = [j for j, batch in zip(every, batches, strict=True) if batch is finished]
    if not jobs:
        return None

    def run():
        try:
            report = b.build(jobs)
            log.info("prompt kernels: %d of %d builds done side by side in %.1f s", report.built, len(jobs),
                     report.seconds)  # fmt: skip
        finally:
            finished.set()

    thread = threading.Thread(target=run, daemon=True, name="kernel-build prompt shapes")
    thread.start()
    return thread


def shared_guard(op: str = "qmm") -> Guard:
    """This process's guard for SPECGATE_HOME's verdicts: the default kernels
    ("qmm"), or the fused sibling-linear kernel ("qmm_fused")."""
    return wiring.shared_guard(kernel_cache_dir(), op)


def prepare(model, setting: str = "auto", widths=range(2, 4), *, guard: Guard | None = None,
            fused_guard: Guard | None = None, one_row: bool = False) -> Wiring:  # fmt: skip
    """specgate.kernels.wiring.prepare; without a `guard`, with SPECGATE_HOME's shared ones."""
    return wiring.prepare(model, setting, widths, guard=guard, fused_guard=fused_guard,
                          cache_dir=kernel_cache_dir(), one_row=one_row)  # fmt: skip


def prove(model, setting: str = "auto", widths=range(2, 4), *, guard: Guard | None = None,
          fused_guard: Guard | None = None, stop=None, one_row: bool = False,
          urgent: bool = False, loaded=None) -> bool:  # fmt: skip
    """specgate.kernels.wiring.prove; without a `guard`, with SPECGATE_HOME's
    shared ones; what it will build, built side by side first (MLX's own
    kernels and ours, by `builder`'s processes;
    `urgent`: ahead of what is queued, as a first speculative token waits).
    With the `loaded` model the proofs run beside (engines/loading.LoadedModel),
    each waits for its turn at the model's lock first (`model_turn`)."""
    turn = None if loaded is None or loaded.lockstep is not None else functools.partial(model_turn, loaded)
    return wiring.prove(model, setting, widths, guard=guard, fused_guard=fused_guard,
                        cache_dir=kernel_cache_dir(), stop=stop, one_row=one_row,
                        builder=builder(), urgent=urgent, turn=turn)  # fmt: skip


def model_turn(loaded) -> None:
    """Returns once the step or round holding the model's lock, and those
    waiting before this call, have had it; the lock is not kept. A proof
    builds its kernel in-process (MLX keeps our kernels out of its disk
    cache), and MLX builds one kernel at a time: proofs back to back held
    off a request's own first builds. On an H100 the first speculative round
    after the switch waited 91 s for the batch widths' proofs; taking turns,
    a round waits for one proof at most, and a proof for one round. Not
    held during the proof: a slow one (tens of seconds for a new tile)
    never stops serving."""
    with loaded.lock:
        pass


class ProofThread:
    """An engine's kernel proofs on a background thread of their own, named
    `kernel-proofs <label>`: `done` is set once its path is decided, and
    `stop` ends them after the proof running (a proof cannot be cut short).
    The speculative engines' verify kernels (mlx_spec/kernel_proofs.py) and
    the plain engine's batch kernels (mlx_plain/kernels.py) are such."""

    def __init__(self, label: str):
        self.label = label  # "<model> <engine>", for the log and the thread's name
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _background(self, run) -> None:
        self._thread = threading.Thread(target=run, daemon=True, name=f"kernel-proofs {self.label}")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the path is decided (within `timeout` seconds)."""
        return self.done.wait(timeout)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


__all__ = ["SETTINGS", "ProofThread", "Wiring", "builder", "describe", "model_shapes",
           "prebuild_forward", "prepare", "prove", "shared_guard"]
