"""specgate: one OpenAI-, Anthropic- and Responses-compatible endpoint in front
of speculative-decoding engines.

Every import name of the distribution lives under this one package, so no
other project's top-level package (Hugging Face's `kernels`, PyPI's
`engines`, `gateway`, `policies`) can collide with it. The subpackages, and
the one direction their imports go:

    gateway -> policies -> engines -> kernels

- gateway/: the HTTP APIs, access, serving, cluster and the operator's CLI;
- policies/: which decoding plan serves a request and a round (pure logic);
- engines/: decoding: the engine registry, the engines, targets, drafting
  methods, caches, checkpoints (runtime code only);
- kernels/: verify-shape kernels, their guard, cost measurement;
- builders/: what specgate makes rather than serves (tiny checkpoints,
  training, GGUF export). Beside the chain: it may import engines/ and
  kernels/; only the CLI's build commands and the demo's first GGUF export
  (gateway/serving/builtins.py) import it, lazily, so `specgate serve`
  never loads it otherwise.

See docs/DESIGN.md, "Layers".
"""

# Before anything imports MLX: its CPU matmuls through OpenBLAS where the
# machine has it (kernels/cpu_blas.py says why).
from specgate.kernels import cpu_blas as _cpu_blas  # noqa: E402

_cpu_blas.bind()
