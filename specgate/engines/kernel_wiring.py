"""kernels/wiring.py as the engines (and `specgate tune`) call it: the shared
guards keep their verdicts in $SPECGATE_HOME/kernels (engines/home.py),
read at each call, since kernels/ sits below the engines and reads no
environment for it."""

from __future__ import annotations

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


__all__ = ["SETTINGS", "Wiring", "describe", "model_shapes", "prepare", "prove", "shared_guard"]
