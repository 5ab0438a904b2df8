"""Plain decoding with mlx-lm continuous batching: the path every request
falls back to when speculation is off."""

from engines.mlx_plain.engine import MLXPlainEngine

__all__ = ["MLXPlainEngine"]
