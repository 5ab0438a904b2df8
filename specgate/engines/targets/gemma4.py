"""Gemma-4 with its vision and audio towers (mlx-lm `gemma4`): the text path's adapter."""

from specgate.engines.targets.gemma4_text import Gemma4Target as Adapter  # noqa: F401
