"""Does a verify forward cost more when its KV length is new? (MLX CUDA vs Metal vs CPU)

    python bench/verify_shape_churn.py [--tiny] [--widths 1,2,3,5,9] [--calls 12]

Speculative rounds verify M = depth + 1 tokens after a KV cache that grows by
a different amount every round, so every round's attention has a shape it
has not seen. On the GPU machine an MTP round measured 45-90 ms where its
parts, timed at a repeated shape, cost 2 ms (the head) and 14 ms (a width-3
verify); the ngram rounds of bench/agent_workloads.py ran at 1.0x plain in a
first pass and 3.6x in the next two, over the same shapes. This times a
4-bit 7B-class qwen3 forward of width M (a) at the same KV length, call
after call, and (b) with the KV length one longer each call (the cache
trimmed to keep one token), and (c) as (b) but through
engines/forwards/kv_buffer.py's whole-buffer views (the keys the whole 256-step
buffer, an explicit mask), median and max of each, side by side.
A gap between (a) and (b) at M >= 2 but not at M = 1 says a per-shape cost
(compilation or planning) in the multi-row attention path; (c) near (a)
says the views remove it.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from specgate.engines.forwards import kv_buffer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU check)")
    ap.add_argument("--widths", default="1,2,3,5,9")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--context", type=int, default=500)
    a = ap.parse_args()
    hidden, layers, mlp, heads, kv, hd, vocab = ((256, 2, 768, 4, 2, 64, 4096) if a.tiny
                                                 else (4096, 28, 12288, 32, 8, 128, 151936))  # fmt: skip
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=mlp, num_attention_heads=heads, rms_norm_eps=1e-6,
                           vocab_size=vocab, num_key_value_heads=kv, max_position_embeddings=32768,
                           head_dim=hd, tie_word_embeddings=False, rope_theta=1e6)  # fmt: skip
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(a.context))]), cache=cache), [c.state for c in cache])
    print(f"mlx {mx.__version__} on {mx.default_device()}; qwen3 hidden {hidden}, {layers} layers, "
          f"4-bit; context {a.context}")

    def call(width: int, keep: int, whole: bool = False) -> float:
        seen = kv_buffer.views(cache, width) if whole else cache
        t0 = time.perf_counter()
        mx.eval(model(mx.array([[7] * width]), cache=seen))
        dt = time.perf_counter() - t0
        for c in cache:
            c.trim(width - keep)
        return 1000 * dt

    print("width | same KV length: median ms | new each call: median, max ms | "
          "new, whole buffer: median, max ms | new/same | whole/same")  # fmt: skip
    for width in [int(w) for w in a.widths.split(",")]:
        call(width, 0)  # this width's first shape
        call(width, 0, whole=True)
        same = sorted(call(width, 0) for _ in range(a.calls))
        grow = sorted(call(width, 1) for _ in range(a.calls))
        whole = sorted(call(width, 1, whole=True) for _ in range(a.calls))
        s, g, w = (x[len(x) // 2] for x in (same, grow, whole))
        print(f"{width:5d} | {s:25.2f} | {g:14.2f}, {grow[-1]:6.1f} | {w:26.2f}, {whole[-1]:6.1f} | "
              f"{g / s:7.2f}x | {w / s:9.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
