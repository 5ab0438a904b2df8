"""A model's own MTP head as an MLX module, and its loader from the checkpoint
(drafting with it: engines/proposers/mtp.py). See docs/DESIGN.md, "Proposers"."""
