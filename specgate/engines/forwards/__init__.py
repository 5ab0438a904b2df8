"""Forwards whose shapes repeat from round to round, so MLX's per-shape work
(cuDNN graphs, compiled traces) is paid once: KV caches seen as whole
buffers, their length on the host or on the device (kv_buffer.py).

May import mlx and mlx-lm only. See docs/DESIGN.md, "Targets".
"""
