"""Plain decoding with mlx-lm continuous batching: the path every request
falls back to when speculation is off. May import the rest of engines/
(not drafting/) and kernels/. See docs/DESIGN.md, "Engines"."""

from specgate.engines.mlx_plain.engine import MLXPlainEngine

__all__ = ["MLXPlainEngine"]
