"""MTP: a model's own multi-token-prediction head as an MLX module (head.py),
its loader from the checkpoint (loading.py), and drafting with it
(proposer.py). Imports as drafting/ says. See docs/DESIGN.md, "Drafting methods"."""
