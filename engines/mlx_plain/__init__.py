"""Plain decoding with mlx-lm continuous batching: the path every request
falls back to when speculation is off. See docs/DESIGN.md, "Engines"."""

from engines.mlx_plain.engine import MLXPlainEngine

__all__ = ["MLXPlainEngine"]
