"""Decoding: the types that cross seams (base.py), the engine registry
(registry.py), the engines, and the targets and proposers the in-process
speculative engine composes. Below policies/, above kernels/; imports
neither policies/ nor gateway/. See docs/DESIGN.md, "Engines"."""
