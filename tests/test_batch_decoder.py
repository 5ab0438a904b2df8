"""Greedy speculative rounds over a batch of sequences (specgate/engines/mlx_spec/batch_decoder.py).

A tiny float32 qwen3 (mlx-lm's model, random weights; its greedy text
repeats, so copied drafts are often right). Sequences with n-gram drafting
at different depths, one at depth 0 (a plain step inside the batch), one
joining mid-way and one leaving mid-way (going on alone from the caches it
takes with it): every sequence's tokens equal its own plain greedy
decoding, and drafts were accepted. Streams the batch cannot serve yet
(sampling, penalties, a hybrid's caches) are refused with a reason.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models import qwen3
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from specgate.engines.base import SamplingParams
from specgate.engines.drafting.ngram.proposer import NgramProposer
from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder, BatchStream
from specgate.engines.targets import target_for

N_TOKENS = 40
VOCAB = 128


@pytest.fixture(scope="module")
def model():
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-6,
                           vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=1024,
                           head_dim=16, tie_word_embeddings=False, rope_theta=10000.0)  # fmt: skip
    mx.random.seed(5)
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    out = []
    for n in (6, 19, 11, 8):
        seg = [rng.randrange(VOCAB) for _ in range(n)]
        out.append(seg + seg[: n // 2])  # something to copy from the start
    return out


def joined(model, decoder, key, prompt):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    decoder.join(BatchStream(key, NgramProposer(), list(prompt), len(prompt)), cache)


def test_batched_rounds_give_each_sequence_its_plain_greedy_text(model):
    ps = prompts()
    refs = [greedy_reference(model, p, N_TOKENS + 8) for p in ps]
    decoder = BatchSpecDecoder(target_for(model))
    for i in range(3):
        joined(model, decoder, f"s{i}", ps[i])
    depths = {"s0": 4, "s1": 2, "s2": 0, "s3": 3}
    out = {f"s{i}": [] for i in range(4)}
    accepted, rounds, alone = 0, 0, None
    while decoder.streams:
        for key, tokens in decoder.round(depths).items():
            out[key] += tokens
            accepted += len(tokens) - 1
        rounds += 1
        if rounds == 3:
            joined(model, decoder, "s3", ps[3])  # joins a batch mid-flight
        if rounds == 5:
            alone = ("s1", decoder.leave("s1"))  # leaves, goes on alone
        for s in list(decoder.streams):
            if len(out[s.key]) >= N_TOKENS:
                decoder.leave(s.key)
    key, cache = alone
    last = ps[1][-1] if not out[key] else out[key][-1]
    while len(out[key]) < N_TOKENS:  # plain greedy on the caches it took with it
        logits = model(mx.array([[last]]), cache=cache)
        last = int(mx.argmax(logits[0, -1]).item())
        out[key].append(last)
    for i, (want, margins) in enumerate(refs):
        assert_same_greedy(out[f"s{i}"][:N_TOKENS], want[:N_TOKENS], margins[:N_TOKENS])
    assert accepted > 0  # copies were drafted and accepted inside the batch


def test_streams_it_cannot_serve_yet_are_refused(model):
    with pytest.raises(ValueError, match="greedy without penalties"):
        BatchStream("t", NgramProposer(), [1, 2], 2, SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="greedy without penalties"):
        BatchStream("p", NgramProposer(), [1, 2], 2,
                    SamplingParams(temperature=0.0, repetition_penalty=1.2))  # fmt: skip
    decoder = BatchSpecDecoder(target_for(model))
    with pytest.raises(ValueError, match="plain KV caches"):
        decoder.join(BatchStream("h", NgramProposer(), [1, 2], 2), [ArraysCache(2)])
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    with pytest.raises(ValueError, match="all its tokens but the last"):
        decoder.join(BatchStream("x", NgramProposer(), [1, 2, 3], 3), cache)
