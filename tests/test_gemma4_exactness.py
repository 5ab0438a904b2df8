"""Gemma-4 with its assistant drafter: what its caches and drafter do beyond exactness.

tests/test_exactness_greedy.py and test_exactness_sampled.py prove the
assistant engine exact on dense, MoE and small Gemma-4 targets (greedy at
every depth, with plain steps between rounds and after the window wrapped,
sampled rounds against the target's law). Here, on tiny float32 Gemma-4
targets in the published layout, dense (sliding and full layers), MoE
(26B-A4B-like: experts beside the MLP, keys as values on full layers) and
small (E2B/E4B-like: per-layer inputs, KV-shared layers), each with a random
assistant (centroid head): the rotating caches really wrap at the window;
a verify cut back after the window wrapped leaves what feeding only the
kept tokens leaves; the assistant reads the target's own K/V without a
copy; the prefix cache keeps snapshots at message boundaries.
"""

from __future__ import annotations

import random

import exactness
import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache
from tiny_targets import TinyTarget

from specgate.builders.drafters import build_gemma4_assistant
from specgate.builders.gemma4 import build_gemma4
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.assistant.gemma4 import check_pairing, load_assistant

WINDOW = exactness.WINDOW


def prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to 60: some wrap the window in the prompt, some while decoding."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(1 + (i * 59) // (n - 1))] for i in range(n)]


@pytest.fixture(scope="module", params=["dense", "moe", "small"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t = build_gemma4(root / "target", variant=request.param, sliding_window=WINDOW, tokenizer=False)
    d = build_gemma4_assistant(root / "assistant", target=t, tokenizer=False)
    return TinyTarget(t, drafter=d, loader=load_assistant, pairing=check_pairing)


def test_the_caches_wrap(pair):
    """Here and in the exactness harness, whose prompts and outputs wrap the window."""
    cache = pair.trunk.make_cache()
    assert any(type(c) is RotatingKVCache and c.max_size == WINDOW for c in cache)
    assert max(map(len, exactness.prompts(pair.vocab))) + exactness.N_TOKENS > 3 * WINDOW


def test_rollback_after_the_window_wrapped_equals_feeding_the_kept_tokens(pair):
    """The caches after a verify of 5 tokens cut back to 2 give the next
    forward the same hidden states as caches that were only ever fed the 2."""
    trunk = pair.trunk
    prompt = prompts(pair.vocab, 2, seed=7)[1]  # 60 tokens: every window has wrapped
    verify = mx.array([[5, 6, 7, 8, 9]])
    cut, fed = trunk.make_cache(), trunk.make_cache()
    for cache in (cut, fed):
        trunk.forward(mx.array([prompt]), cache)
    forward = trunk.forward(verify, cut, undo="tape")
    trunk.rollback(cut, forward, 2)
    trunk.forward(verify[:, :2], fed)
    for tokens in ([[11]], [[12, 13, 14]]):
        a = trunk.forward(mx.array(tokens), cut).hidden
        b = trunk.forward(mx.array(tokens), fed).hidden
        # The same entries in another order in a rotating buffer: in float32
        # (engines/precision.py) the sums differ by ~2e-5; a wrong cut by ~1.
        assert mx.allclose(a, b, atol=1e-4).item()
    assert [c.offset for c in cut] == [c.offset for c in fed]


def test_the_assistant_reads_the_target_kv_without_copying(pair):
    trunk = pair.trunk
    cache = trunk.make_cache()
    trunk.forward(mx.array([prompts(pair.vocab, 2)[1]]), cache)
    kv = trunk.drafter_kv(cache, pair.drafter.sliding_window)
    assert set(kv) == {"sliding_attention", "full_attention"}
    keys, _, seen = kv["sliding_attention"]
    assert keys is cache[trunk.kv_layer["sliding_attention"]].keys  # the cache's own array
    assert int(seen.sum().item()) == WINDOW - 1  # the latest window less the query's own slot


def test_the_prefix_cache_keeps_snapshots_at_message_boundaries(tmp_path):
    """A wrapped window cannot be cut back to where a later prompt parts, so
    Gemma-4 models get the snapshots hybrids get: at message boundaries."""
    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    path = build_gemma4(tmp_path / "g", sliding_window=WINDOW)
    prefix = load_mlx_model(str(path), CacheSettings(disk_bytes=0)).prefix_cache
    assert not prefix.trimmable
    request = GenerationRequest("t", "m", list(range(300)), SamplingParams(), 8,
                                Plan("mlx_plain", "none", 0, "rule"), boundaries=(120, 250))
    assert {120, 250} <= set(prefix.snapshot_points(request, 0))
