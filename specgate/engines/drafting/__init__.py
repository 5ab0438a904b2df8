"""Drafting methods for the speculative decoder, one folder each with its
model and its proposer together: mtp/ (the checkpoint's own MTP head),
dflash/ and dspark/ (block drafters on the target's layer features),
assistant/ (Gemma-4 -assistant drafters), ngram/ (self-drafting from the
context), and mtp_ngram.py (the two combined). base.py is the contract
every proposer meets.

May import what sits below an engine in engines/ (base.py, targets/,
sampling.py, grammar/, loading.py, mlx_load.py, cache/, checkpoints/) and
kernels/; never an engine, the registry or anything above engines/. One
method may build on another: dspark/ on dflash/'s backbone, mtp_ngram.py on
mtp/ and ngram/ (tests/test_layering.py holds the rest). See docs/DESIGN.md, "Drafting methods".
"""
