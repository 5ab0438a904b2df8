"""Verify-shape kernels, the guard that proves them per machine, their
per-instance hook, and cost measurement for `specgate tune`. The lowest
layer: imports nothing of specgate's. See docs/DESIGN.md, "Kernels", and
kernels/README.md."""
