"""The plain engine's batch steps through the proved small-M kernels.

A step of B sequences multiplies B rows by every weight matrix. On CUDA,
MLX's stock `quantized_matmul` runs a per-row matrix-vector kernel below 8
rows, which re-reads the weights for every row: on an H100 a plain step of
4 streams cost ~3.5 one-stream steps, so mlx-lm's continuous batching gave
246 tok/s at 4 streams against ~218 for one. The small-M kernels the
speculative engines verify through (kernels/qmm.py, qmm_mma.py) read each
weight once for 2..16 rows; a verify forward of 4 rows through them cost
~1.1 one-row forwards on an H200 (kernels/README.md).

So the plain engine proves the same kernels for every width 2..16, off its
load path (as engines/mlx_spec/kernel_proofs.py does; a speculative
engine's lone widths go first, since its first speculative token waits on
them: these proofs yield to them between two verdicts), and then runs its
`BatchGenerator` steps inside `hook.kernels()`. Every width, not only the
batch sizes it can reach: a step also prefills prompt chunks, and a chunk
of 2..16 rows must find its shape proved (a proof inside a step stalls
every stream for seconds on a GPU).

The lone loop (lone.py) runs inside them too. It proves every shape at one
row as well, and each layer's compiled one-row halves (forwards/one_row.py)
get a second pair traced with their products through the kernels
(hook.one_row), used while the kernels are on: MLX's one-row `qmv` moved
~0.7 TB/s on an H100, the tensor-core kernel about twice that, and inside
a compiled trace MLX replays its launches from C++ (bench/plain_probe.py
"mmac": 1.14x `generate_step` where the GPU bounds decoding). Outside a
trace, at one row, only an lm_head goes through them (hook.WIDE_N: 194
against MLX's 330 us on an H100). A shape the guard found slower at one
row stays MLX's there.

What it changes in the numbers: a row's product is the kernel's (within
the guard's bound of the exact product), as in a speculative engine's
verify, where before it was MLX's matrix-vector kernel's. Greedy tokens
are the same unless two logits lie within that rounding.

Off where the config says `kernels: off`, and for a model over several
ranks (its ranks would prove apart, and could decide apart).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from specgate.engines import kernel_wiring  # the guards' verdicts in SPECGATE_HOME
from specgate.engines.forwards.one_row import compile_one_row_kernels
from specgate.engines.loading import LoadedModel
from specgate.kernels import hook, qmm
from specgate.kernels.guard import Unproved, recorded_only

log = logging.getLogger(__name__)

# Every width a step's products may have: a batch's rows, or a prompt chunk's.
WIDTHS = range(qmm.MIN_M, qmm.MAX_M + 1)


class BatchKernels(kernel_wiring.ProofThread):
    """Whether the plain engine's batch steps run through the kernels:
    `on` turns true once every width is proved and warmed."""

    def __init__(self, label: str, loaded: LoadedModel, setting: str, warm_widths: range,
                 guard=None, fused_guard=None):  # fmt: skip
        """warm_widths: the batch sizes to warm (one step each) once proved;
        guard None: SPECGATE_HOME's shared guards."""
        super().__init__(label)
        self.loaded, self.setting = loaded, setting
        self.warm_widths = warm_widths
        self.guard, self.fused_guard = guard, fused_guard
        self.on = False  # read by the worker before each step
        self.wiring = None  # what kernels/wiring.py decided, once it has
        self.one_row_layers = 0  # layers whose one-row step runs through them (forwards/one_row.py)

    def start(self) -> None:
        if self.setting == "off" or self.loaded.lockstep is not None:
            self.done.set()
            return
        self._background(self._run)

    def _run(self) -> None:
        """Prove (or read back), wire, trace the one-row kernel halves, warm;
        `done` set whatever happens (`on` only once all of it did)."""
        model = self.loaded.model
        kw = {"guard": self.guard, "fused_guard": self.fused_guard}
        try:
            try:
                with recorded_only():  # all recorded (a later process): no proof, no wait
                    kernel_wiring.prove(model, self.setting, WIDTHS, one_row=True, **kw)
            except Unproved:
                if not self._prove(model, kw):
                    return
            with self.loaded.lock:  # (it swaps the linears' classes: between two steps)
                wired = kernel_wiring.prepare(model, self.setting, WIDTHS, one_row=True, **kw)
                self.wiring = wired
                if wired.enabled:
                    self.one_row_layers = compile_one_row_kernels(model, hook.enabled, _one_row_kernels)
            if not wired.enabled:
                return
            for width in self.warm_widths:
                if self._stop.is_set():
                    return
                with self.loaded.lock:
                    self._warm(width)
            self.on = True
            log.info("%s: batch steps through kernels/hook.py from now on (%s); one-row steps "
                     "through them in %d layers", self.label, wired.reason, self.one_row_layers)  # fmt: skip
        except Exception:
            log.exception("%s: proving its batch kernels failed; batch steps stay stock", self.label)
        finally:
            self.done.set()

    def _prove(self, model, kw: dict) -> bool:
        """Every verdict, proved one engine at a time (LoadedModel.proving:
        a speculative engine of this model may have recorded most of them,
        read back here), and after any proof a first speculative token waits
        for (LoadedModel.urgent_proofs): this yields the lock to one between
        two verdicts and takes it again once none is pending. False: stopped."""
        urgent = self.loaded.urgent_proofs
        yielding = _Either(self._stop, lambda: urgent.pending)
        while not self._stop.is_set():
            urgent.wait_none(self._stop)
            with self.loaded.proving:
                if kernel_wiring.prove(model, self.setting, WIDTHS, stop=yielding, one_row=True,
                                       loaded=self.loaded, **kw):  # fmt: skip
                    return True
        return False

    def _warm(self, width: int) -> None:
        """One decoding step of `width` sequences through the kernels, on a
        throwaway cache: MLX builds that graph's kernels now, not in the
        first step that has this many streams."""
        model = self.loaded.model
        cache = make_prompt_cache(model)
        with hook.kernels():
            mx.eval(model(mx.zeros((width, 1), dtype=mx.int32), cache=cache))


class _Either:
    """What kernels/wiring.prove checks between two verdicts: an event set,
    or a condition true."""

    def __init__(self, event: threading.Event, condition) -> None:
        self.event, self.condition = event, condition

    def is_set(self) -> bool:
        return self.event.is_set() or self.condition()


@contextmanager
def _one_row_kernels():
    """What forwards/one_row.py traces its kernel halves in: kernels on, one
    row included."""
    with hook.kernels(), hook.one_row():
        yield
