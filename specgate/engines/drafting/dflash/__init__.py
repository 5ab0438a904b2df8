"""DFlash: a block drafter conditioned on the target's layer features, as an
MLX module with its loader (model.py), and drafting with it (proposer.py).
Imports as drafting/ says. See docs/DESIGN.md, "Drafting methods"."""
