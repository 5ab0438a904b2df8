"""The target model behind a speculative decoder: one adapter per model family.

`target_for(model)` picks the adapter the way mlx-lm picks model files: by
the name of the mlx-lm module the model comes from (`mlx_lm.models.qwen3_5`
-> `engines/targets/qwen3_5.py`, whose `Adapter` it builds). A family
without its own module gets `TransformerTarget`, which serves any model
whose caches are all KVCaches and refuses the rest by name. A new family is
one module here; nothing else is edited. May import engines/base.py,
forwards/kv_buffer.py and kernels/. See docs/DESIGN.md, "Targets".
"""

from __future__ import annotations

import importlib

import mlx.nn as nn

from specgate.engines.targets.base import Forward, Target, TransformerTarget, Undo

__all__ = ["Forward", "Target", "TransformerTarget", "Undo", "target_for"]


def target_for(model: nn.Module) -> Target:
    family = type(model).__module__.rsplit(".", 1)[-1]
    try:
        module = importlib.import_module(f"specgate.engines.targets.{family}")
    except ModuleNotFoundError as e:
        if e.name != f"specgate.engines.targets.{family}":
            raise
        return TransformerTarget(model)
    adapter = getattr(module, "Adapter", None)
    return TransformerTarget(model) if adapter is None else adapter(model)
