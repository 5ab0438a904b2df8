"""Builders: what specgate makes rather than reads.

- tiny checkpoints in every published layout, for tests and the demo
  (tiny.py, qwen3_next.py, drafters.py, traps.py, _build.py) and the
  tokenizer they share (tokenizer.py);
- the two MLX training loops behind `specgate demo-model` and
  `specgate demo-drafter` (demo_training.py, dflash_training.py) and their
  arguments (training_args.py);
- the GGUF export of a Qwen3.5 hybrid with its MTP head (gguf_export.py);
- the builtin models (builtin_models.py: `builtin:demo` and friends, shipped
  in demo/ and demo_dflash/, the GGUF exported on first use).

It sits above the engines, not beside engines/checkpoints/ (which only
reads and judges): training runs the engines' own target, MTP head and
DFlash drafter (engines.targets, engines.mlx_mtp, engines.mlx_block), so a
builder may import any engine module, and no module under engines/ other
than these may import it back. gateway/ (the CLI, the config's builtin
names) may. See docs/DESIGN.md, "Checkpoints, builders, home".
"""
