"""Qwen3-Next (mlx-lm `qwen3_next`): the hybrid adapter with its own GatedDeltaNet class."""

from __future__ import annotations

from mlx_lm.models import qwen3_next

from specgate.engines.targets.qwen3_5 import HybridTarget


class Qwen3NextTarget(HybridTarget):
    recurrent = qwen3_next.Qwen3NextGatedDeltaNet


Adapter = Qwen3NextTarget
