"""llama.cpp backend: finding, building and running `llama-server` (a
process per speculation mode of a GGUF model: plain, draft-mtp, n-gram).
Runs no MLX: may import engines/base.py, home.py, memory.py and
checkpoints/. See docs/DESIGN.md, "Engines"."""
