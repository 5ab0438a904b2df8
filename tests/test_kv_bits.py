"""`kv_bits`: a model's KV cache quantized to 4 or 8 bits (engines/forwards/
quantized_kv.py), under every engine (issue 46).

At temperature 0 every speculative engine's output equals plain greedy
decoding's over the same quantized cache (mlx-lm's `generate_step` on the
model whose caches quantize: tests/exactness.py's references), with the
method's own drafts and with injected ones that force every accepted
length. The plain engine's continuous batching (mlx-lm's BatchGenerator
over `BatchQuantizedKV`) gives each sequence what it gives alone.
"""

from __future__ import annotations

import exactness
import pytest

# One family per engine (its first), one depth: the full sweeps run unquantized.
CASES = [(r.name, exactness.needs_of(r).greedy[0], bits)
         for r in exactness.speculative_records() for bits in (4, 8)]  # fmt: skip


@pytest.mark.parametrize("engine_name,family,bits", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_speculation_equals_plain_decoding_over_the_same_quantized_cache(engine_name, family, bits,
                                                                         tmp_path_factory):  # fmt: skip
    s = exactness.subject(tmp_path_factory.getbasetemp() / "exactness", engine_name, family,
                          kv_bits=bits)  # fmt: skip
    assert type(s.model.make_cache()[-1]).__name__ in ("QuantizedKVCache", "RotatingKVCache")
    depth = s.depths[min(2, len(s.depths) - 1)]
    sweep = exactness.greedy_sweep(s, depth)
    assert set(range(depth + 1)) <= set(sweep.lengths), sweep.lengths
