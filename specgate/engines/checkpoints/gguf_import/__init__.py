"""GGUF files imported into Hugging Face / MLX checkpoint directories."""
