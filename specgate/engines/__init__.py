"""Decoding, runtime code only: the types that cross seams (base.py), the
engine registry and each engine's settings (registry.py, settings.py), the
engines (mlx_plain/, mlx_spec/ for every in-process speculative method,
llamacpp/) and the worker thread every MLX engine decodes on (worker.py),
the targets (targets/) and drafting methods (drafting/) the speculative
engine composes, the prompt caches (cache/), execution over several ranks
(distributed/), and checkpoints read without loading them (checkpoints/).

Below policies/, above kernels/: imports neither policies/ nor gateway/, and
never builders/. See docs/DESIGN.md, "Engines".
"""
