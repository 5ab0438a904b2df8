"""Block drafters conditioned on the target's layer features, as MLX modules: DFlash
and DSpark (drafting with them: engines/proposers/dflash.py, dspark.py). See
docs/DESIGN.md, "Proposers"."""
