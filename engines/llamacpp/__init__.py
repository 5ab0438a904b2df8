"""llama.cpp draft-mtp backend: finding, building and running `llama-server`."""
