"""llama.cpp backend: finding, building and running `llama-server` (a
process per speculation mode of a GGUF model: plain, draft-mtp, n-gram).
See docs/DESIGN.md, "Engines"."""
