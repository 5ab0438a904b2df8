"""llama.cpp draft-mtp backend: finding, building and running `llama-server`
(two processes per GGUF model, plain and draft-mtp). See docs/DESIGN.md,
"Engines"."""
