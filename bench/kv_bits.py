"""KV-cache memory and decode speed with `kv_bits`, side by side (issue 46).

    uv run python bench/kv_bits.py [--model PATH] [--contexts 8192,32768] [--reps 5]

For each context length, the model is loaded three ways (its KV cache as
computed, 8-bit and 4-bit: engines/forwards/quantized_kv.py, as the model
setting `kv_bits` loads it), a prompt of that many tokens is prefilled in
2,048-token chunks, and then greedy decoding is timed, `--tokens` tokens a
repeat, the three sides interleaved in rotating order, each repeat trimmed
back to the prompt (on a hybrid, whose
recurrent state cannot be trimmed, the repeats carry on from each other:
only the timing is read). Prints the KV cache's bytes (the attention
layers' caches as allocated: mlx-lm grows them 256 tokens at a time), the
prefill and decode tokens/s, and each quantized side over the unquantized
one, median [min, max] over the repeats. Default model: the shipped demo
(a Qwen3.5 hybrid, one attention layer in four); SmolLM2's GGUF (a dense
llama) shows a dense model's cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import specgate  # noqa: E402,F401  (first: it binds MLX's BLAS before MLX loads)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from specgate.engines.base import CacheSettings  # noqa: E402
from specgate.engines.checkpoints.builtin import default_model_path  # noqa: E402
from specgate.engines.loading import load_mlx_model  # noqa: E402

SIDES = (None, 8, 4)


def summary(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def kv_bytes(cache: list) -> int:
    return sum(c.nbytes for c in cache if type(c).__name__ in ("KVCache", "QuantizedKVCache"))


class Side:
    """One way of keeping the cache: the model loaded so, a prompt prefilled."""

    def __init__(self, path: str, bits: int | None, context: int, seed: int, dequantize: bool):
        loaded = load_mlx_model(path, CacheSettings(disk_bytes=0), dequantize=dequantize, kv_bits=bits)
        self.model, self.bits = loaded.model, bits
        self.prompt = mx.random.randint(0, loaded.vocab_size - 8, (context,),
                                        key=mx.random.key(seed)).tolist()  # fmt: skip
        self.cache = make_prompt_cache(self.model)
        t0 = time.perf_counter()
        for i in range(0, context - 1, 2048):
            self.model(mx.array(self.prompt[i: min(i + 2048, context - 1)])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.prefill = (context - 1) / (time.perf_counter() - t0)
        self.memory = kv_bytes(self.cache)
        self.trimmable = all(c.is_trimmable() for c in self.cache)
        self.decode: list[float] = []

    def decode_once(self, tokens: int) -> None:
        y = mx.array([[self.prompt[-1]]])
        t0 = time.perf_counter()
        for _ in range(tokens):
            y = mx.argmax(self.model(y, cache=self.cache)[:, -1], axis=-1)[None]
            mx.eval(y)
        self.decode.append(tokens / (time.perf_counter() - t0))
        if self.trimmable:
            for c in self.cache:
                c.trim(tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory or GGUF (default: the demo)")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens a repeat")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dequantize", action="store_true",
                    help="the model setting: a quantized checkpoint's layers dense (a CPU's MLX "
                         "runs quantized matmuls ~50x slower than OpenBLAS's float32)")
    a = ap.parse_args()
    path = a.model or str(default_model_path())
    contexts = [int(x) for x in a.contexts.split(",")]
    print(f"model {path}{' (dequantized)' if a.dequantize else ''}; MLX on {mx.default_device()}; "
          f"{a.reps} repeats of {a.tokens} tokens")  # fmt: skip
    rows = []
    for context in contexts:
        sides = [Side(path, bits, context, seed=context, dequantize=a.dequantize) for bits in SIDES]
        for rep in range(a.reps):  # interleaved, the order rotating
            for side in sides[rep % len(sides):] + sides[: rep % len(sides)]:
                side.decode_once(a.tokens)
        base = sides[0]
        for g in sides:
            ratios = [x / y for x, y in zip(g.decode, base.decode, strict=True)]
            rows.append([str(context), f"{g.bits}-bit" if g.bits else "as computed",
                         f"{g.memory / (1 << 20):.1f} MiB", f"{g.memory / base.memory:.2f}",
                         f"{g.prefill:.0f}", summary(g.decode, ".1f"), summary(ratios)])  # fmt: skip
            print(f"  {context} tokens, {rows[-1][1]}: {rows[-1][2]}, decode {rows[-1][5]} tok/s",
                  flush=True)  # fmt: skip
    head = ["context", "KV cache", "KV bytes", "bytes / as computed", "prefill tok/s",
            "decode tok/s", "decode / as computed"]  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
