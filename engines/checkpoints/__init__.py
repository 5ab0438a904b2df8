"""Checkpoint formats, read and judged without loading any weights: configs,
safetensors headers, GGUF key/value tables, tokenizer files (reader.py,
gguf_info.py), the families specgate knows (families.py), where a name
lives (locate.py), verdicts and `specgate inspect` (verdicts.py, inspect.py).

Reading only, and no MLX: what builds checkpoints (tiny fixtures, training,
GGUF export, the builtin models) is engines/builders/; mlx-lm's load is
engines/mlx_load.py. See docs/DESIGN.md, "Checkpoints, builders, home".
"""
