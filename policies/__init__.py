"""Routing policy: which decoding plan serves each request and round, and
why (no MLX, no HTTP). See docs/DESIGN.md, "Policies"."""
