"""Builders: what specgate makes rather than serves.

- tiny checkpoints in every published layout, for tests and the demo
  (tiny.py, qwen3_next.py, gemma4.py, drafters.py, traps.py, _build.py) and
  the tokenizer they share (tokenizer.py);
- the two MLX training loops behind `specgate demo-model` and
  `specgate demo-drafter` (demo_training.py, dflash_training.py) and their
  settings and options (training_args.py);
- the GGUF export of a Qwen3.5 hybrid with its MTP head, and of Gemma-4
  (gguf_export.py, gguf_gemma4.py).

The shipped demo models themselves are runtime data
(engines/checkpoints/builtin.py). Beside the gateway -> policies -> engines
-> kernels chain, not in it: training runs the engines' own target, MTP head
and DFlash drafter, so a builder may import engines/ and kernels/ (never
gateway/ or policies/), and nothing under engines/, kernels/ or policies/
imports it. In gateway/, only operator/cli.py (the demo-model and
demo-drafter commands) and serving/builtins.py (the demo's GGUF, exported on
first use) import it, lazily: `specgate serve` never loads it otherwise
(tests/test_layering.py, tests/test_cli.py). See docs/DESIGN.md,
"Checkpoints, builders, home".
"""
