"""At temperature > 0 the MTP engine samples exactly the target's distribution.

A tiny Qwen3.5 hybrid with a 12-token vocabulary and a random MTP head (so
drafts disagree with the target often, which is where a wrong rule shows).
From one fixed prefix, the engine's first two tokens of a depth-2 round are
drawn N times with temperature 1.0, top-k and top-p, and compared with the
target's exact joint distribution p(a) p(b | a), computed by plain forwards.

Bound: for n samples over m outcomes, E[TV] <= 0.5 sqrt(m/n); the test
allows 3x that (McDiarmid: a correct sampler fails with probability
< exp(-2m) for a random seed; the seeds here are fixed). A deliberately
wrong rule (the residual with p and q swapped) must fail the same check,
on a quarter of the samples (its bias is large; the bound widens with it).
(Sample-and-compare, accepting a draft iff it equals a token drawn from p and
committing that token, is *not* a wrong rule: it is exact, only less
efficient, so it cannot serve as the negative control.)
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import mlx.core as mx
import pytest
from exactness import wrong_rule
from mlx_lm.utils import load_model

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec import (
    decoder as decoder_module,  # where the acceptance rules are called
)
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.sampling import probabilities
from specgate.engines.targets import target_for

N = 8_000
# Unseeded: the rule under test is rejection sampling (a seeded request's is
# Gumbel-max, tests/test_seeded_sampling.py); each sample seeds MLX's own
# random state, so the run is reproducible.
PARAMS = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = build_qwen35_hybrid(
        tmp_path_factory.mktemp("v12"), vocab_size=12, hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        tokenizer=False, seed=11,
    )
    model, config = load_model(path)
    loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
    return target_for(model), load_mtp_head(loaded), model


def exact_pairs(model, prefix: list[int]) -> dict[tuple[int, int], float]:
    def dist(tokens):
        return probabilities(model(mx.array([tokens]))[0, -1], PARAMS).tolist()

    first = dist(prefix)
    joint = {}
    for a, pa in enumerate(first):
        if pa > 0:
            for b, pb in enumerate(dist(prefix + [a])):
                if pb > 0:
                    joint[(a, b)] = pa * pb
    return joint


def sample_pairs(trunk, head, n: int) -> tuple[Counter, list[int], float]:
    request = GenerationRequest("d", "m", PROMPT, PARAMS, 10, Plan("mlx_mtp", "mtp", 2, "spec_on"))
    d = SpecDecoder(trunk, MTPProposer(trunk, head), request, None, 0, None)
    mx.random.seed(0)
    d.prefill()  # commits the first token; the rounds below are what we test
    # Every sample restarts from here: KV caches are trimmed back to these
    # offsets and recurrent states restored (they are replaced, never
    # written in place), which is much cheaper than copying the caches.
    head = d.proposer  # the head's state: its cache, and the entries owed to it
    fields = {k: copy.copy(v) for k, v in vars(d).items() if k not in ("cache", "proposer")}
    head_fields = {k: copy.copy(v) for k, v in vars(head).items() if k != "cache"}
    kv = [(c, c.offset) for c in d.cache + head.cache if hasattr(c, "offset")]
    arrays = [(c, list(c.cache)) for c in d.cache if not hasattr(c, "offset")]
    counts, accepted, drafted = Counter(), 0, 0
    for i in range(n):
        for c, offset in kv:
            c.trim(c.offset - offset)
        for c, saved in arrays:
            c.cache = list(saved)
        vars(d).update({k: copy.copy(v) for k, v in fields.items()})
        vars(head).update({k: copy.copy(v) for k, v in head_fields.items()})
        mx.random.seed(1000 + i)
        got = []
        while len(got) < 2:
            step = d.round(2)
            got += step.tokens
            accepted, drafted = accepted + step.stats.accepted, drafted + step.stats.drafted
        counts[tuple(got[:2])] += 1
    return counts, fields["tokens"], accepted / drafted


def tv(counts: Counter, exact: dict, n: int) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts[k] / n - exact.get(k, 0.0)) for k in keys)


# The proof tier's largest engine-level sample (8,000 rounds, ~2 min on CI's
# 2 cores: MLX's per-op overhead on tiny graphs, not arithmetic). The rule
# itself is proved exactly on arrays (tests/test_speculative.py); this and
# tests/test_exactness_sampled.py check the wiring around it.
@pytest.mark.proof
@pytest.mark.timeout(900)
@pytest.mark.parametrize("rule,n", [("leviathan", N), ("wrong", N // 4)])
def test_engine_samples_the_target_distribution(target, rule, n, monkeypatch, capsys):
    trunk, head, model = target
    if rule == "wrong":  # failure injection: the engine with a broken rule
        monkeypatch.setattr(decoder_module, "accept_sampled", wrong_rule)
    counts, prefix, acceptance = sample_pairs(trunk, head, n)
    exact = exact_pairs(model, prefix)
    bound = 3 * 0.5 * math.sqrt(len(exact) / n)
    distance = tv(counts, exact, n)
    with capsys.disabled():
        print(f"[{rule}: TV {distance:.4f}, bound {bound:.4f}, {len(exact)} outcomes, "
              f"acceptance {acceptance:.2f}]", end=" ")
    if rule == "leviathan":
        assert acceptance > 0.1  # accepted drafts and bonus tokens are in the sample
        assert set(counts) <= set(exact)  # never a token the target truncated away
        assert distance < bound
    else:
        assert distance > bound
