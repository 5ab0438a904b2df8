"""Forwards whose shapes repeat from token to token, so MLX's per-shape work
(cuDNN graphs, compiled traces) is paid once: caches seen as whole buffers
(kv_buffer.py) and a one-token forward compiled once (compiled.py).

May import mlx and mlx-lm only. See docs/DESIGN.md, "Targets" and "Engines".
"""
