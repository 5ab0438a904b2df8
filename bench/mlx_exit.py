"""The end of a bench that ran MLX engines in-process."""

from __future__ import annotations

import os
import sys


def end_process(code: int = 0) -> None:
    """Ends the process without the interpreter's teardown of MLX. Every
    engine is stopped and its thread joined before this is called, but
    MLX's CUDA build has still aborted at exit ('terminate called without
    an active exception', status 134) after engine threads had used the
    GPU: its static objects go while the threads' own are still being
    torn down. Everything is printed and written first."""
    import mlx.core as mx

    mx.synchronize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
