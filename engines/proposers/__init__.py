"""Drafters for the speculative decoder, one module per method (mtp, dflash,
dspark), behind base.Proposer. See docs/DESIGN.md, "Proposers"."""
