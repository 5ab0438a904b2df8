"""DSpark: DFlash's block drafter with a sequential head, as an MLX module with
its loader (model.py), and drafting with it (proposer.py). Imports as drafting/ says.
See docs/DESIGN.md, "Drafting methods"."""
