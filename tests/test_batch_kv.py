"""A batch of sequences verified together, each keeping its own rows (specgate/engines/forwards/batch_kv.py).

On a tiny float32 qwen3 (mlx-lm's model, random weights), three prompts of
different lengths are prefilled alone, joined into one BatchOffsetKV per
layer, and decoded by batched greedy verify rounds: each sequence feeds
[last, d_1..d_k], its drafts the reference continuation with one position
corrupted (or none), so each round keeps a different number of rows per
sequence and leaves rejected rows in the buffer. Every sequence's tokens
equal its own plain greedy decoding; a sequence that leaves mid-way (and
continues alone from the cache it takes with it) and the ones that stay
are exact too. A mask that shows one column too many (failure injection)
is caught.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from specgate.engines.forwards import batch_kv
from specgate.engines.forwards.batch_kv import BatchOffsetKV

N_TOKENS = 20
VOCAB = 256


def tiny_qwen3(vocab: int, seed: int):
    """mlx-lm's qwen3, 2 layers of width 64, float32, random weights."""
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-6,
                           vocab_size=vocab, num_key_value_heads=2, max_position_embeddings=1024,
                           head_dim=16, tie_word_embeddings=False, rope_theta=10000.0)  # fmt: skip
    mx.random.seed(seed)
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(VOCAB, 7)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 9)]


def prefilled(model, prompt):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    return cache


def solo_round(model, cache, last, drafts) -> tuple[list[int], int]:
    """One greedy verify round of one sequence on its own KVCache: the
    tokens it commits, and the next `last`."""
    chosen = mx.argmax(model(mx.array([[last, *drafts]]), cache=cache)[0], axis=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == chosen[a]:
        a += 1
    for c in cache:
        c.trim(len(drafts) - a)
    return [*drafts[:a], chosen[a]], chosen[a]


def batched_decode(model, refs, leave_at=None):
    """Greedy verify rounds over the batch until every sequence has
    N_TOKENS; sequence 0 leaves after `leave_at` rounds and goes on alone."""
    rng = random.Random(11)
    ps = prompts()
    caches = [prefilled(model, p) for p in ps]
    batch = [BatchOffsetKV.from_caches([c[layer] for c in caches]) for layer in range(len(caches[0]))]
    last = [p[-1] for p in ps]
    out = [[] for _ in ps]
    live = list(range(len(ps)))  # the batch's rows, by sequence
    lengths = [len(p) - 1 for p in ps]
    alone = None  # sequence 0's own cache once it left
    rounds, kept_counts = 0, set()
    while any(len(out[s]) < N_TOKENS for s in live):
        k = 1 + rounds % 3
        drafts = []
        for s in live:
            true = refs[s][len(out[s]) : len(out[s]) + k] + [0] * k
            d = true[:k]
            if (wrong := rng.randrange(k + 1)) < k:
                d[wrong] = (d[wrong] + 1) % VOCAB
            drafts.append(d)
        rows = mx.array([[last[s], *drafts[i]] for i, s in enumerate(live)])
        chosen = mx.argmax(model(rows, cache=batch), axis=-1)  # (B, k + 1)
        d_arr = mx.array(drafts)
        accepted = mx.cumprod((d_arr == chosen[:, :k]).astype(mx.int32), axis=1).sum(axis=1)
        for c in batch:
            c.keep(accepted + 1)
        acc, ch = accepted.tolist(), chosen.tolist()
        for i, s in enumerate(live):
            out[s] += [*drafts[i][: acc[i]], ch[i][acc[i]]]
            last[s] = ch[i][acc[i]]
            lengths[s] += acc[i] + 1
            kept_counts.add(acc[i] + 1)
        for c in batch:
            c.settle([lengths[s] for s in live])
        rounds += 1
        if leave_at is not None and rounds == leave_at:
            alone = [c.sequence(live.index(0), lengths[0]) for c in batch]
            stay = [i for i, s in enumerate(live) if s != 0]
            live = [live[i] for i in stay]
            for c in batch:
                c.filter(stay)
    if alone is not None:
        while len(out[0]) < N_TOKENS:
            k = 2
            committed, last[0] = solo_round(model, alone, last[0], refs[0][len(out[0]) : len(out[0]) + k])
            out[0] += committed
    return [o[:N_TOKENS] for o in out], kept_counts


@pytest.mark.parametrize("leave_at", [None, 3])
def test_batched_verify_rounds_equal_each_sequence_alone(model, leave_at):
    refs, margins = zip(*(greedy_reference(model, p, N_TOKENS + 4) for p in prompts()), strict=True)
    got, kept_counts = batched_decode(model, list(refs), leave_at)
    for s, tokens in enumerate(got):
        assert_same_greedy(tokens, refs[s][:N_TOKENS], margins[s][:N_TOKENS])
    assert len(kept_counts) > 2  # sequences kept different numbers of rows in a round


def test_a_mask_showing_one_stale_column_is_caught(model, monkeypatch):
    """Failure injection: a mask one column too wide lets each query see the
    next (stale or unwritten) column; the batch must then go wrong."""
    make_mask = BatchOffsetKV.make_mask

    def too_wide(self, n, return_array=False, window_size=None):
        m = make_mask(self, n, return_array, window_size)
        return m | mx.pad(m[..., :-1], [(0, 0), (0, 0), (0, 0), (1, 0)])

    monkeypatch.setattr(batch_kv.BatchOffsetKV, "make_mask", too_wide)
    refs = [greedy_reference(model, p, N_TOKENS + 4)[0] for p in prompts()]
    got, _ = batched_decode(model, refs)
    assert any(g != r[:N_TOKENS] for g, r in zip(got, refs, strict=True))


def test_join_and_leave_keep_each_sequence_as_it_was(model):
    ps = prompts()
    caches = [prefilled(model, p) for p in ps]
    layer = BatchOffsetKV.from_caches([c[0] for c in caches])
    assert layer.offset.tolist() == [len(p) - 1 for p in ps] and layer.keys.shape[2] == 256
    def rows(c):
        return c.keys[:, :, : c.offset], c.values[:, :, : c.offset]

    for b, c in enumerate(caches):
        back = layer.sequence(b, len(ps[b]) - 1)
        assert back.offset == c[0].offset
        assert all(mx.array_equal(x, y) for x, y in zip(rows(back), rows(c[0]), strict=True))
    layer.filter([2, 0])
    assert layer.offset.tolist() == [len(ps[2]) - 1, len(ps[0]) - 1]
    assert mx.array_equal(rows(layer.sequence(1, len(ps[0]) - 1))[0], rows(caches[0][0])[0])
