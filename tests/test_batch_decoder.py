"""Speculative rounds over a batch of sequences (specgate/engines/mlx_spec/batch_decoder.py).

A tiny float32 qwen3 (mlx-lm's model, random weights; its greedy text
repeats, so copied drafts are often right), each sequence a SpecDecoder
with n-gram drafting: greedy at depths 4, 2 and 0 (a plain step inside the
batch), seeded sampling, a repetition penalty, one joining mid-way and one
leaving mid-way (going on alone on the caches it takes with it). Each
sequence's tokens equal what it produces decoded alone (greedy and seeded:
its plain decoding, up to a checked near-tie), and drafts were accepted
inside the batch. Keeping every verified row instead of what each
sequence accepted (failure injection) is caught. What the batch cannot
take yet (a hybrid's caches, a decoder mid-way) is refused with a reason.
On tests/test_ahead.py's bigram trunk, sequences drafting with the MTP
head (each its own head caches) beside an n-gram one are exact too, and
most of their drafts stand. On a tiny Qwen3.5 hybrid (GatedDeltaNet
layers, each row's state kept by the verify forward's tape) the same
streams, and MTP streams on its own head, are exact as well.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference, seeded_reference
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
from test_ahead import trunk  # noqa: F401  (the bigram trunk fixture)
from test_batch_kv import tiny_qwen3

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.drafting.ngram.proposer import NgramProposer
from specgate.engines.forwards.batch_kv import BatchOffsetKV
from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.targets import target_for

N_TOKENS = 40
VOCAB = 128
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=11)
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.3)
# key: (prompt index, sampling, depth)
STREAMS = {"s0": (0, GREEDY, 4), "s1": (1, GREEDY, 2), "s2": (2, GREEDY, 0),
           "s3": (3, SEEDED, 3), "s4": (4, PENALISED, 3), "s5": (5, GREEDY, 3)}  # fmt: skip
JOINS_AT, LEAVES_AT = 3, 5  # s5 joins after round 3; s1 leaves after round 5


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(VOCAB, 5)


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    out = []
    for n in (6, 19, 11, 8, 14, 9):
        seg = [rng.randrange(VOCAB) for _ in range(n)]
        out.append(seg + seg[: n // 2])  # something to copy from the start
    return out


def decoder(target, key: str, proposer=None) -> SpecDecoder:
    i, params, depth = STREAMS[key]
    request = GenerationRequest(key, "m", prompts()[i], params, N_TOKENS,
                                Plan("mlx_ngram", "ngram", depth, "spec_on"))  # fmt: skip
    return SpecDecoder(target, proposer or NgramProposer(), request, None, 0, None)


def alone(target, key: str) -> list[int]:
    d = decoder(target, key)
    step = d.prefill()
    tokens = list(step.tokens)
    while step.finish_reason is None:
        step = d.round(STREAMS[key][2])
        tokens += step.tokens
    return tokens


def batched(target, proposer=None) -> tuple[dict[str, list[int]], int]:
    """`proposer(key)`: each stream's (default: n-gram)."""
    batch, out, accepted = BatchSpecDecoder(target), {}, 0

    def join(key):
        d = decoder(target, key, proposer(key) if proposer else None)
        out[key] = list(d.prefill().tokens)
        batch.join(key, d)

    for key in ("s0", "s1", "s2", "s3", "s4"):
        join(key)
    depths = {key: depth for key, (_, _, depth) in STREAMS.items()}
    rounds, left = 0, None
    while batch.decoders:
        for key, step in batch.round(depths).items():
            out[key] += step.tokens
            accepted += sum(step.stats.accepted_per_position)
            if step.finish_reason is not None:
                batch.leave(key)
        rounds += 1
        if rounds == JOINS_AT:
            join("s5")
        if rounds == LEAVES_AT and "s1" in batch.decoders:
            left = batch.leave("s1")
    step = None
    while left is not None and (step is None or step.finish_reason is None):
        step = left.round(STREAMS["s1"][2])  # alone, on the caches it took with it
        out["s1"] += step.tokens
    return out, accepted


def test_each_sequence_in_the_batch_decodes_as_it_would_alone(model):
    target = target_for(model)
    got, accepted = batched(target)
    ps = prompts()
    for key, (i, params, _) in STREAMS.items():
        if params is GREEDY:
            want, margins = greedy_reference(model, ps[i], N_TOKENS)
        elif params is SEEDED:
            want, margins = seeded_reference(model, ps[i], N_TOKENS, params)
        else:  # penalised: the same decoder alone (tests/test_exactness_greedy.py holds it to plain)
            want, margins = alone(target, key), [1.0] * N_TOKENS
        assert_same_greedy(got[key], want, margins)
    assert accepted > 0  # copies were drafted and accepted inside the batch


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 hybrid (GatedDeltaNet layers beside attention, every
    second layer), float32, random weights."""
    from mlx_lm.utils import load_model

    from specgate.builders.tiny import build_qwen35_hybrid

    path = build_qwen35_hybrid(tmp_path_factory.mktemp("hybrid"), vocab_size=VOCAB, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=4, full_attention_interval=2,
                               tokenizer=False, with_mtp=False, seed=3)  # fmt: skip
    model, _ = load_model(path)
    model.set_dtype(mx.float32)
    return model


def test_a_hybrid_s_sequences_decode_in_the_batch_each_as_alone(hybrid):
    """The same streams on a hybrid: each row's conv window and recurrent
    state after its own kept steps, picked from the verify forward's tape
    (HybridTarget.keep_rows), beside the attention layers' own rows; one
    joining and one leaving mid-way (going on alone on the state it takes)."""
    from test_ngram_exactness import InjectedNgram

    target = target_for(hybrid)
    assert any(type(c) is ArraysCache for c in target.make_cache())
    ps = prompts()
    # A random hybrid's text rarely repeats: each stream's n-gram index
    # first sees its own continuation (decoded alone), every 7th token
    # corrupted, so drafts stand in part and are cut in the batch.
    truth = {key: alone(target, key) for key in STREAMS}

    def injected(key):
        wrong = [(t + 1) % VOCAB if j % 7 == 6 else t for j, t in enumerate(truth[key])]
        return InjectedNgram(ps[STREAMS[key][0]] + wrong)

    got, accepted = batched(target, injected)
    for key, (i, params, _) in STREAMS.items():
        if params is GREEDY:
            want, margins = greedy_reference(hybrid, ps[i], N_TOKENS)
        elif params is SEEDED:
            want, margins = seeded_reference(hybrid, ps[i], N_TOKENS, params)
        else:
            want, margins = alone(target, key), [1.0] * N_TOKENS
        assert_same_greedy(got[key], want, margins)
    assert accepted > 0


def test_keeping_every_verified_row_is_caught(model, monkeypatch):
    """Failure injection: each sequence keeps all its rows, the rejected
    drafts' included; some sequence must then go wrong."""
    keep = BatchOffsetKV.keep
    monkeypatch.setattr(BatchOffsetKV, "keep", lambda self, kept: keep(self, mx.full(kept.shape,
                        int(self._last[1]), dtype=mx.int32)))  # fmt: skip
    got, _ = batched(target_for(model))
    ps = prompts()
    assert any(got[k] != greedy_reference(model, ps[STREAMS[k][0]], N_TOKENS)[0]
               for k in ("s0", "s1", "s5"))  # fmt: skip


class _Rotating:
    """A target whose caches are a sliding window's (as Gemma-4's are)."""

    def __init__(self, target):
        self.target = target

    def make_cache(self):
        return [RotatingKVCache(8)]

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_what_the_batch_cannot_take_is_refused(model):
    target = target_for(model)
    batch = BatchSpecDecoder(target)
    d = decoder(target, "s0")
    d.prefill()
    batch.join("s0", d)
    with pytest.raises(ValueError, match="already in the batch"):
        batch.join("s0", decoder(target, "s1"))
    fresh = decoder(target, "s1")  # not prefilled: its caches hold nothing yet
    with pytest.raises(ValueError, match="all its tokens but the last"):
        batch.join("s1", fresh)
    rotating = decoder(target, "s2")
    rotating.cache = [RotatingKVCache(8)]  # Gemma-4's sliding windows: not batched
    with pytest.raises(ValueError, match=r"caches \(RotatingKVCache\) are not batched"):
        rotating.target = _Rotating(target)
        BatchSpecDecoder(rotating.target).join("s2", rotating)
    assert d.cache is None  # the batch holds it while joined
    back = batch.leave("s0")
    assert back is d and [c.offset for c in d.cache] == [len(d.tokens) - 1] * len(d.cache)
    assert batch.caches is None and not batch.decoders


def test_mtp_streams_draft_with_their_own_head_caches_inside_the_batch(trunk):  # noqa: F811
    """On tests/test_ahead.py's bigram trunk, whose MTP head drafts well:
    sequences drafting with the head at depths 3, 2 and 1, beside an
    n-gram one, each equal their plain greedy decoding, and most drafts
    stand (the head's state per sequence follows what its row kept)."""
    from test_ahead import head as bigram_head

    model, args = trunk
    rng = random.Random(9)
    ps = [[rng.randrange(model.args.vocab_size) for _ in range(n)] for n in (5, 12, 8, 3)]
    drafted, accepted = mtp_beside_ngram(model, bigram_head(args, 0.05), ps)
    assert accepted > 0.8 * drafted > 0


def mtp_beside_ngram(model, head, ps: list[list[int]]) -> tuple[int, int]:
    """Four streams in one batch, the first three drafting with `head` at
    depths 3, 2 and 1, the last with n-grams at 3; each must equal its plain
    greedy decoding. Returns the MTP streams' (drafted, accepted)."""
    target = target_for(model)
    batch, out, depths = BatchSpecDecoder(target), {}, {}
    drafted = accepted = 0
    for i, (p, depth) in enumerate(zip(ps, (3, 2, 1, 3), strict=True)):
        proposer = MTPProposer(target, head) if i < 3 else NgramProposer()
        request = GenerationRequest(f"m{i}", "m", p, GREEDY, N_TOKENS,
                                    Plan("mlx_mtp", "mtp", depth, "spec_on"))  # fmt: skip
        d = SpecDecoder(target, proposer, request, None, 0, None)
        out[f"m{i}"], depths[f"m{i}"] = list(d.prefill().tokens), depth
        batch.join(f"m{i}", d)
    while batch.decoders:
        for key, step in batch.round(depths).items():
            out[key] += step.tokens
            drafted += step.stats.drafted if key != "m3" else 0
            accepted += sum(step.stats.accepted_per_position) if key != "m3" else 0
            if step.finish_reason is not None:
                batch.leave(key)
    for i, p in enumerate(ps):
        want, margins = greedy_reference(model, p, N_TOKENS)
        assert_same_greedy(out[f"m{i}"], want, margins)
    return drafted, accepted


def test_a_hybrid_s_mtp_head_drafts_inside_the_batch(tmp_path):
    """A Qwen3.5 hybrid drafting with its own MTP head (random: few drafts
    stand) at depths 3, 2 and 1 beside an n-gram stream, in one batch whose
    recurrent layers each row keeps by the tape: every stream equals its
    plain greedy decoding."""
    from mlx_lm.utils import load_model

    from specgate.builders.tiny import build_qwen35_hybrid
    from specgate.engines.drafting.mtp.loading import load_mtp_head
    from specgate.engines.loading import load_mlx_model

    path = build_qwen35_hybrid(tmp_path / "hybrid-mtp", vocab_size=512, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=4, full_attention_interval=2,
                               seed=5)  # fmt: skip  (512: room for its tokenizer, which loading wants)
    model, _ = load_model(path)
    model.set_dtype(mx.float32)
    head = load_mtp_head(load_mlx_model(str(path)))
    head.set_dtype(mx.float32)
    drafted, _ = mtp_beside_ngram(model, head, prompts()[:4])
    assert drafted > 0
