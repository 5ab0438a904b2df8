"""Qwen3.5 / Qwen3.6 MoE hybrids (mlx-lm `qwen3_5_moe`): the same layers as qwen3_5."""

from specgate.engines.targets.qwen3_5 import HybridTarget as Adapter  # noqa: F401
