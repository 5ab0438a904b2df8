"""Forwards whose shapes repeat from round to round, so MLX's per-shape work
(cuDNN graphs, compiled traces) is paid once: KV caches seen as whole
buffers, their length on the host or on the device (kv_buffer.py); a batch
of sequences, each at its own length on the device, so a batched verify
keeps a different number of rows per sequence without moving data
(batch_kv.py, the base of speculation inside the decode batch: issue 45).

May import mlx and mlx-lm only. See docs/DESIGN.md, "Targets".
"""
