"""N-gram self-drafting: the suffix index over the context (index.py), the
copy length that maximizes expected tokens per second (copy_length.py), and
the proposer (proposer.py). Needs no drafter model. Imports as drafting/ says.
See docs/DESIGN.md, "Drafting methods"."""
