"""kernels/wiring.py as the engines (and `specgate tune`) call it: the shared
guards keep their verdicts in $SPECGATE_HOME/kernels (engines/home.py),
read at each call, since kernels/ sits below the engines and reads no
environment for it."""

from __future__ import annotations

import threading

from specgate.engines.home import kernel_cache_dir
from specgate.kernels import wiring
from specgate.kernels.guard import Guard
from specgate.kernels.wiring import SETTINGS, Wiring, describe, model_shapes


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
          fused_guard: Guard | None = None, stop=None, one_row: bool = False) -> bool:  # fmt: skip
    """specgate.kernels.wiring.prove; without a `guard`, with SPECGATE_HOME's shared ones."""
    return wiring.prove(model, setting, widths, guard=guard, fused_guard=fused_guard,
                        cache_dir=kernel_cache_dir(), stop=stop, one_row=one_row)  # fmt: skip


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


__all__ = ["SETTINGS", "ProofThread", "Wiring", "describe", "model_shapes", "prepare", "prove",
           "shared_guard"]
