"""Drafters that read the target's own K/V cache, as MLX modules: Gemma-4's
`-assistant` drafters (drafting with them: engines/proposers/assistant.py).
See docs/DESIGN.md, "Proposers"."""
