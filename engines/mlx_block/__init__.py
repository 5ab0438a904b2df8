"""Block drafters conditioned on the target's hidden states: DFlash (and DSpark to come)."""
