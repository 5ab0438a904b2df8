"""Gemma-4 -assistant drafters, which read the target's own K/V cache: the
MLX module and loader (gemma4.py), and drafting with it (proposer.py). Imports as drafting/ says.
See docs/DESIGN.md, "Drafting methods"."""
