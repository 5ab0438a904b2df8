"""DSpark speculative decoding: exact at temperature 0 and at temperature 1.

Tiny float32 targets (dense Qwen3, hybrid Qwen3.5) with random DeepSpec-layout
DSpark drafters (Markov head, confidence head, embedding -1 among the target
layers). Greedy output equals plain greedy decoding at every depth 1..block;
drafts are injected (failure injection, as in the DFlash test) so every
accepted length happens. At temperature 1 the first tokens of a round follow
the target's exact distribution under Leviathan-Chen acceptance with q from
the Markov-corrected logits, and a deliberately wrong rule fails the check.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import mlx.core as mx
import pytest
from greedy import assert_same_greedy
from test_dflash_exactness import BUILDERS, Target, exact_pairs, prompts
from test_mtp_distribution import wrong_rule

from engines import spec_decoder
from engines.base import GenerationRequest, Plan, SamplingParams
from engines.builders.drafters import build_dspark_drafter
from engines.builders.tiny import build_qwen35_hybrid
from engines.mlx_block.dspark import load_dspark
from engines.proposers.base import Proposal
from engines.proposers.dspark import DSparkProposer
from engines.spec_decoder import SpecDecoder

BLOCK = 4


class DSparkTarget(Target):
    def __init__(self, path, drafter_path):
        super().__init__(path, drafter_path, loader=load_dspark)


@pytest.fixture(scope="module", params=list(BUILDERS))
def target(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t = BUILDERS[request.param](root / "target", tokenizer=False)
    d = build_dspark_drafter(root / "dspark", target=t, block_size=BLOCK, num_hidden_layers=2,
                             target_layer_ids=[-1, 2], tokenizer=False)
    return DSparkTarget(t, d)


class InjectedDrafts(DSparkProposer):
    """Failure injection: the drafter drafts (and cuts), then its proposals are
    replaced by the reference continuation with one token corrupted (or none)."""

    def __init__(self, *args, reference: list[int], rng: random.Random):
        super().__init__(*args)
        self.reference, self.rng = reference, rng

    def propose(self, context, depth):
        q = super().propose(context, depth)
        q = None if q is None else q.q
        n = depth  # ignore the confidence cut: every length must be exercised
        true = self.reference[context.generated : context.generated + n]
        true += [0] * (n - len(true))
        wrong = self.rng.randrange(n + 1)
        if wrong < n:
            true[wrong] = (true[wrong] + 1) % 7
        return Proposal(mx.array(true), q)


def decode(target, prompt, depth, params=None, cls=DSparkProposer, max_tokens=64, **inject):
    params = params or SamplingParams(temperature=0)
    request = GenerationRequest("t", "m", prompt, params, max_tokens,
                                Plan("mlx_dspark", "dspark", depth, "spec_on"))
    decoder = SpecDecoder(target.trunk, cls(target.trunk, target.drafter, **inject), request,
                          None, 0, None)
    step = decoder.prefill()
    tokens, rounds = list(step.tokens), []
    while step.finish_reason is None:
        step = decoder.round(depth)
        tokens += step.tokens
        rounds.append(step.stats)
    return tokens, rounds


@pytest.mark.parametrize("depth", range(1, BLOCK + 1))
def test_greedy_equals_plain_at_every_depth(target, depth, capsys):
    ties = accepted = cut = 0
    for i, prompt in enumerate(prompts(target.vocab)):
        want, margins = target.reference(prompt)
        got, rounds = decode(target, prompt, depth)
        ties += assert_same_greedy(got, want, margins)
        assert all(r.method == "dspark" and r.drafted <= depth for r in rounds)
        cut += sum(r.drafted < depth for r in rounds)
        got, rounds = decode(target, prompt, depth, cls=InjectedDrafts, reference=want,
                             rng=random.Random(i))
        ties += assert_same_greedy(got, want, margins)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 0
    with capsys.disabled():
        print(f"[depth {depth}: {ties} near-tie divergence(s), {cut} confidence cuts]", end=" ")


N = 6000
SAMPLED = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
PREFIX = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("v12")
    t = build_qwen35_hybrid(
        root / "target", vocab_size=12, hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        tokenizer=False, seed=11,
    )
    # No confidence head: every round drafts, so the rule is exercised every time.
    d = build_dspark_drafter(root / "dspark", target=t, block_size=3, num_hidden_layers=1,
                             mask_token_id=11, markov_rank=4, enable_confidence_head=False,
                             confidence_head_with_markov=False, tokenizer=False)
    return DSparkTarget(t, d)


@pytest.mark.parametrize("rule", ["leviathan", "wrong"])
def test_sampled_output_follows_the_target_distribution(small, rule, monkeypatch, capsys):
    if rule == "wrong":
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
