"""Checkpoint formats, read and judged without loading any weights: configs,
safetensors headers, GGUF key/value tables, tokenizer files (reader.py,
gguf_info.py), the families specgate knows (families.py), where a name
lives (locate.py; Ollama's store, LM Studio's folder and GGUF repos in the
hub cache: sources.py, ollama_store.py, lmstudio_store.py, gguf_pick.py), verdicts and `specgate inspect` (verdicts.py, inspect.py),
and the checkpoints specgate ships (builtin.py: `builtin:demo` and friends,
in demo/ and demo_dflash/).

Reading only, and no MLX: may import engines/home.py and nothing else of
specgate's. What builds checkpoints (tiny fixtures, training, GGUF export)
is builders/; mlx-lm's load is engines/mlx_load.py. See docs/DESIGN.md,
"Checkpoints, builders, home".
"""
