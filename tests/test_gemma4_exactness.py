"""Gemma-4 with its assistant drafter: exact at temperature 0 and at temperature 1.

Tiny float32 Gemma-4 targets in the published layout, dense (sliding and
full layers), MoE (26B-A4B-like: experts beside the MLP, keys as values on
full layers) and small (E2B/E4B-like: per-layer inputs, KV-shared layers),
each with a random assistant (centroid head) built for it. The sliding
window is 16 tokens and prompts run up to 60, so verify rollback happens
after the rotating caches have wrapped. Greedy output equals plain mlx-lm
greedy decoding at every depth, with the drafter's own drafts (almost
always wrong) and with injected ones (failure injection: the drafter drafts
as usual, then its proposals are replaced by the true continuation
corrupted at a chosen position, so every accepted-prefix length happens).
At temperature 1 the first tokens of a round follow the target's exact
distribution under Leviathan-Chen acceptance with q from the centroid
head, and a deliberately wrong rule fails the check.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.utils import load_model
from test_mtp_distribution import wrong_rule

from engines import spec_decoder
from engines.base import GenerationRequest, Plan, SamplingParams
from engines.builders.drafters import build_gemma4_assistant
from engines.builders.gemma4 import build_gemma4
from engines.mlx_assistant.gemma4 import check_pairing, load_assistant
from engines.proposers.assistant import AssistantProposer
from engines.proposers.base import Proposal
from engines.sampling import probabilities
from engines.spec_decoder import SpecDecoder
from engines.targets import target_for

WINDOW = 16
N_TOKENS = 48


class Pair:
    def __init__(self, target_path, drafter_path):
        model, _ = load_model(target_path)
        model.set_dtype(mx.float32)
        self.model, self.trunk = model, target_for(model)
        self.drafter = load_assistant(drafter_path)
        check_pairing(self.drafter, self.trunk)
        self.vocab = self.trunk.vocab_size
        self._references: dict = {}

    def reference(self, prompt: list[int], n: int = N_TOKENS):
        key = (tuple(prompt), n)
        if key not in self._references:
            self._references[key] = greedy_reference(self.model, prompt, n)
        return self._references[key]


def prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to 60: some wrap the window in the prompt, some while decoding."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(1 + (i * 59) // (n - 1))] for i in range(n)]


@pytest.fixture(scope="module", params=["dense", "moe", "small"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t = build_gemma4(root / "target", variant=request.param, sliding_window=WINDOW, tokenizer=False)
    d = build_gemma4_assistant(root / "assistant", target=t, tokenizer=False)
    return Pair(t, d)


class InjectedDrafts(AssistantProposer):
    """Failure injection: the assistant drafts, then its proposals are replaced
    by the reference continuation with one token corrupted (or none)."""

    def __init__(self, *args, reference: list[int], rng: random.Random):
        super().__init__(*args)
        self.reference, self.rng = reference, rng

    def propose(self, context, depth):
        super().propose(context, depth)
        true = self.reference[context.generated : context.generated + depth]
        true += [0] * (depth - len(true))
        wrong = self.rng.randrange(depth + 1)  # depth: all drafts right
        if wrong < depth:
            true[wrong] = (true[wrong] + 1) % 7
        return Proposal(mx.array(true))


def decode(pair, prompt, depth, params=None, cls=AssistantProposer, max_tokens=N_TOKENS,
           undo="tape", schedule=None, **inject):  # fmt: skip
    """`schedule`: the depth of each round in turn (cycled), instead of `depth`."""
    params = params or SamplingParams(temperature=0)
    request = GenerationRequest("t", "m", prompt, params, max_tokens,
                                Plan("mlx_assistant", "gemma4_assistant", depth, "spec_on"))
    decoder = SpecDecoder(pair.trunk, cls(pair.trunk, pair.drafter, **inject), request, None, 0,
                          None, undo=undo)  # fmt: skip
    step = decoder.prefill()
    tokens, rounds = list(step.tokens), []
    while step.finish_reason is None:
        step = decoder.round(depth if schedule is None else schedule[len(rounds) % len(schedule)])
        tokens += step.tokens
        rounds.append(step.stats)
    return tokens, rounds


def test_the_caches_wrap(pair):
    cache = pair.trunk.make_cache()
    assert any(type(c) is RotatingKVCache and c.max_size == WINDOW for c in cache)
    assert max(map(len, prompts(pair.vocab))) + N_TOKENS > 3 * WINDOW


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_greedy_equals_plain_at_every_depth(pair, depth, capsys):
    ties = accepted = 0
    for i, prompt in enumerate(prompts(pair.vocab)):
        want, margins = pair.reference(prompt)
        got, rounds = decode(pair, prompt, depth)
        ties += assert_same_greedy(got, want, margins)
        assert all(r.method == "gemma4_assistant" and r.drafted == depth for r in rounds)
        got, rounds = decode(pair, prompt, depth, cls=InjectedDrafts, reference=want,
                             rng=random.Random(i))  # fmt: skip
        ties += assert_same_greedy(got, want, margins)
        accepted += sum(r.accepted for r in rounds)
        lengths = {r.accepted for r in rounds}
        assert lengths >= set(range(depth + 1)) or len(rounds) < 4 * (depth + 1)
    assert accepted > 0
    with capsys.disabled():
        print(f"[depth {depth}: {ties} near-tie divergence(s), {accepted} accepted]", end=" ")


def test_plain_steps_between_rounds(pair):
    """One-token forwards after a rollback (a round the policy runs plain)
    update a rotating cache in place, where a cut that only moved its
    counters would overwrite the wrong slot."""
    for i, prompt in enumerate(prompts(pair.vocab, 6, seed=1)):
        want, margins = pair.reference(prompt)
        got, rounds = decode(pair, prompt, 0, cls=InjectedDrafts, reference=want,
                             rng=random.Random(i), schedule=[3, 0, 2, 0, 0, 1])  # fmt: skip
        assert_same_greedy(got, want, margins)
        assert any(r.accepted < r.drafted for r in rounds)


def test_replay_rollback_gives_the_same_tokens(pair):
    for i, prompt in enumerate(prompts(pair.vocab, 4, seed=3)):
        want = pair.reference(prompt)[0]
        tape, _ = decode(pair, prompt, 3, cls=InjectedDrafts, reference=want, rng=random.Random(i))
        replay, _ = decode(pair, prompt, 3, cls=InjectedDrafts, reference=want,
                           rng=random.Random(i), undo="replay")  # fmt: skip
        assert tape == replay


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
        assert mx.allclose(a, b, atol=1e-5).item()
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


# -- temperature > 0 ------------------------------------------------------------------

N = 6000
SAMPLED = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
PREFIX = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # longer than the window: rounds attend across a wrap


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 12-token dense Gemma-4 with a window of 4 and a centroid-head assistant
    (4 clusters of 3 tokens, top 2): q is a real, imperfect distribution."""
    root = tmp_path_factory.mktemp("v12")
    t = build_gemma4(root / "target", vocab_size=12, hidden_size=32, intermediate_size=64,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     global_head_dim=16, sliding_window=4, num_hidden_layers=3, tokenizer=False,
                     seed=11)  # fmt: skip
    d = build_gemma4_assistant(root / "assistant", target=t, hidden_size=32, num_centroids=4,
                               centroid_intermediate_top_k=2, tokenizer=False, seed=5)  # fmt: skip
    return Pair(t, d)


def exact_pairs(model, prefix: list[int]) -> dict[tuple[int, int], float]:
    def dist(tokens):
        return probabilities(model(mx.array([tokens]))[0, -1], SAMPLED).tolist()

    return {(a, b): pa * pb for a, pa in enumerate(dist(prefix)) if pa > 0
            for b, pb in enumerate(dist(prefix + [a])) if pb > 0}  # fmt: skip


# 6000 seeded decodes: a few minutes on 2 cores; the timeout is a hang guard.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("rule", ["leviathan", "wrong"])
def test_sampled_output_follows_the_target_distribution(small, rule, monkeypatch, capsys):
    """From one prefix, a depth-2 round's two first tokens over many seeds
    against the target's exact p(a) p(b | a), conditioned on the commonest
    prefill token; bound 3 x 0.5 sqrt(m/n) as in the MTP test."""
    if rule == "wrong":  # failure injection: the residual with p and q swapped
        monkeypatch.setattr(spec_decoder, "accept_sampled", wrong_rule)
    n = N if rule == "leviathan" else N // 4
    by_first: dict[int, Counter] = {}
    accepted = 0
    for seed in range(n):
        params = SamplingParams(**{**vars(SAMPLED), "seed": seed})
        tokens, rounds = decode(small, PREFIX, 2, params=params, max_tokens=3)
        accepted += sum(r.accepted for r in rounds)
        by_first.setdefault(tokens[0], Counter())[tuple(tokens[1:3])] += 1
    first, counts = max(by_first.items(), key=lambda kv: sum(kv[1].values()))
    m = sum(counts.values())
    exact = exact_pairs(small.model, PREFIX + [first])
    distance = 0.5 * sum(abs(counts[k] / m - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    bound = 3 * 0.5 * math.sqrt(len(exact) / m)
    with capsys.disabled():
        print(f"[{rule}: TV {distance:.4f}, bound {bound:.4f}, {len(exact)} outcomes, "
              f"{accepted} drafts accepted]", end=" ")
    if rule == "leviathan":
        assert accepted > 0 and set(counts) <= set(exact) and distance < bound
    else:
        assert distance > bound


def test_the_prefix_cache_keeps_snapshots_at_message_boundaries(tmp_path):
    """A wrapped window cannot be cut back to where a later prompt parts, so
    Gemma-4 models get the snapshots hybrids get: at message boundaries."""
    from engines.base import CacheSettings
    from engines.loading import load_mlx_model

    path = build_gemma4(tmp_path / "g", sliding_window=WINDOW)
    prefix = load_mlx_model(str(path), CacheSettings(disk_bytes=0)).prefix_cache
    assert not prefix.trimmable
    request = GenerationRequest("t", "m", list(range(300)), SamplingParams(), 8,
                                Plan("mlx_plain", "none", 0, "rule"), boundaries=(120, 250))
    assert {120, 250} <= set(prefix.snapshot_points(request, 0))
