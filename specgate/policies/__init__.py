"""Routing policy: which decoding plan serves each request and round, and
why (no MLX, no HTTP). May import engines/ (its types and registry
records) and kernels/; never gateway/. See docs/DESIGN.md, "Policies"."""
