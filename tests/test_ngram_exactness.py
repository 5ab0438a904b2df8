"""Drafts copied from the context (ngram, mtp+ngram) leave the output exactly the target's.

Greedy: on tiny float32 targets, dense (Qwen3: KV trim) and hybrid (Qwen3.5:
GatedDeltaNet rollback), the output equals plain greedy decoding token for
token at depths 1..8. Random models repeat themselves, so copies happen on
their own; a second run injects a context (failure injection: the index is
handed a copy of the true continuation with every few tokens corrupted,
placed before the real context, so the real index finds long matches and
copies up to the next corruption), forcing every accepted-prefix length.
With sampling penalties, copied rounds give what plain steps give (each
verify position judged with the penalties of the tokens before it).

Sampled, on a dense and a hybrid 12-token target: a copied draft is a
point mass; the decoder accepts d with
probability p(d) and resamples from p without d. From one prefix whose
last bigram has occurred before, a depth-2 round's first two tokens are
drawn many times and compared with the target's exact p(a) p(b | a); a
deliberately wrong rule (after a rejection, draw from p itself, d
included) must fail the same check.

mtp+ngram: the same greedy check on the hybrid with its MTP head, copies and
head drafts interleaved; and after copied rounds, the head's cache holds
exactly what feeding it the whole sequence at once gives (the copied tokens
were owed to it with the trunk's hidden states). Once more with the
multi-row forwards over whole KV buffers (engines/kv_buffer.py).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from engines import spec_decoder, speculative
from engines.base import GenerationRequest, Plan, SamplingParams
from engines.builders.tiny import build_qwen3_dense, build_qwen35_hybrid
from engines.loading import LoadedModel
from engines.mlx_mtp.loading import load_mtp_head
from engines.ngram_index import NgramIndex
from engines.prefix_cache import PrefixCache
from engines.proposers.copy_length import MIN_ROUNDS, CopyEvidence
from engines.proposers.mtp_ngram import MTPNgramProposer
from engines.proposers.ngram import NgramProposer
from engines.sampling import probabilities
from engines.spec_decoder import SpecDecoder
from engines.targets import target_for

BUILDERS = {"qwen3_dense": build_qwen3_dense, "qwen35_hybrid": build_qwen35_hybrid}
N_TOKENS = 48


class Target:
    def __init__(self, path, mtp: bool):
        model, config = load_model(path)
        model.set_dtype(mx.float32)
        self.model, self.trunk = model, target_for(model)
        self.vocab = self.trunk.vocab_size
        self.head = None
        if mtp:
            self.head = load_mtp_head(LoadedModel(str(path), model, None, config, PrefixCache(str(path))))
            self.head.set_dtype(mx.float32)
        self._references: dict = {}

    def reference(self, prompt: list[int], n: int = N_TOKENS):
        key = (tuple(prompt), n)
        if key not in self._references:
            self._references[key] = greedy_reference(self.model, prompt, n)
        return self._references[key]


@pytest.fixture(scope="module", params=list(BUILDERS))
def target(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), tokenizer=False)
    return Target(path, mtp=request.param == "qwen35_hybrid")


def prompts(vocab: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    """Random prompts, half of them repeating a span (copies to be found)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(vocab - 3) for _ in range(rng.randint(2, 30))]
        out.append(p + p[: rng.randint(2, len(p))] if i % 2 else p)
    return out


def corrupted(tokens: list[int], rng: random.Random, vocab: int, gap: int) -> list[int]:
    """`tokens` with one in every 1..gap replaced by another token. A copy
    drafts at most as many tokens as it matched, so a round drafting k that
    accepts j needs k + j clean tokens in a row: gaps up to 2 k + 2."""
    out, i = list(tokens), rng.randint(0, gap - 1)
    while i < len(out):
        out[i] = (out[i] + 1 + rng.randrange(vocab - 1)) % vocab
        i += rng.randint(1, gap)
    return out


class InjectedContext:
    """Failure injection: the index sees `earlier` (the prompt and a corrupted
    copy of the true continuation) before the real context."""

    def __init__(self, earlier: list[int]):
        self.earlier = earlier

    def draft(self, context, depth):
        if not hasattr(self, "injected"):
            self.injected = NgramIndex()
            self.injected.extend(self.earlier)
            self.start = len(self.injected)
        seen = len(self.injected) - self.start
        self.injected.extend(context.tokens[seen:])
        return self.injected.draft(depth)


class InjectedNgram(InjectedContext, NgramProposer):
    def __init__(self, earlier: list[int], evidence: CopyEvidence | None = None):
        InjectedContext.__init__(self, earlier)
        NgramProposer.__init__(self, evidence=evidence)


def decode(target: Target, prompt, depth, proposer, params=None, max_tokens=N_TOKENS):
    params = params or SamplingParams(temperature=0)
    request = GenerationRequest("t", "m", prompt, params, max_tokens,
                                Plan("mlx_ngram", proposer.method, depth, "spec_on"))  # fmt: skip
    decoder = SpecDecoder(target.trunk, proposer, request, None, 0, None)
    step = decoder.prefill()
    tokens, rounds = list(step.tokens), []
    while step.finish_reason is None:
        step = decoder.round(depth)
        tokens += step.tokens
        rounds.append(step.stats)
    return tokens, rounds, decoder


@pytest.mark.parametrize("depth", [1, 2, 4, 8])
def test_ngram_equals_plain_greedy(target, depth, capsys):
    ties, natural, lengths = 0, 0, Counter()
    for i, prompt in enumerate(prompts(target.vocab)):
        want, margins = target.reference(prompt)
        got, rounds, _ = decode(target, prompt, depth, NgramProposer())
        ties += assert_same_greedy(got, want, margins)
        assert all(r.method == "ngram" and r.depth == depth and r.drafted <= depth for r in rounds)
        natural += sum(r.drafted for r in rounds)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 2 * depth + 2)
        got, rounds, _ = decode(target, prompt, depth, InjectedNgram(earlier))
        ties += assert_same_greedy(got, want, margins)
        lengths.update(r.accepted for r in rounds if r.drafted == depth)
    assert natural > 0  # the model repeated itself and the copies were verified
    assert set(range(depth + 1)) <= set(lengths), lengths  # every accepted-prefix length
    with capsys.disabled():
        print(f"[depth {depth}: {natural} drafts copied naturally, accepted lengths "
              f"{dict(sorted(lengths.items()))}, {ties} near-tie divergence(s)]", end=" ")


class RecordedEvidence(CopyEvidence):
    """CopyEvidence that also records each cut it made: (offered, kept)."""

    def __init__(self):
        super().__init__()
        self.cuts = []

    def length(self, match, offered):
        kept = super().length(match, offered)
        self.cuts.append((offered, kept))
        return kept


def test_copies_cut_by_evidence_decode_the_same(target):
    """Evidence primed as on a CPU (a verify row a third of a step, short
    matches that seldom stand) cuts copies short and to nothing; greedy
    output stays plain decoding's."""
    evidence = RecordedEvidence()
    for width, seconds in ((1, 0.013), (9, 0.045)):
        for _ in range(MIN_ROUNDS + 1):  # the first of each width is its warm-up
            evidence.observe(None if width == 1 else 16, width - 1, width - 1, seconds)
    for match in (2, 3, 4, 6):
        for i in range(20):
            evidence.observe(match, 4, 1 if i % 3 == 0 else 0, 0.025)
    ties = 0
    for i, prompt in enumerate(prompts(target.vocab)):
        want, margins = target.reference(prompt)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 6)
        got, _, _ = decode(target, prompt, 4, InjectedNgram(earlier, evidence))
        ties += assert_same_greedy(got, want, margins)
    cut = [(offered, kept) for offered, kept in evidence.cuts if kept < offered]
    assert any(kept == 0 for _, kept in cut) and any(kept > 0 for _, kept in cut)


@pytest.mark.parametrize("advance", ["per_position", "stale"])
def test_penalties_advance_per_position_inside_a_copy(target, advance, monkeypatch):
    """Greedy with presence, frequency and repetition penalties: each verify
    position is judged with the penalties of the tokens before it (drafts
    included), so copied rounds give what plain steps (depth 0) give. The
    negative control (failure injection: every position judged with the
    round's first penalties) must differ somewhere; it runs on the hybrid,
    whose outputs repeat tokens within a window."""
    if advance == "stale":
        if target.head is None:
            pytest.skip("the negative control runs on the hybrid")
        monkeypatch.setattr(spec_decoder, "advanced", lambda state, tokens: state)
    params = SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.3,
                            repetition_penalty=1.2)  # fmt: skip
    accepted, same = 0, []
    for i, prompt in enumerate(prompts(target.vocab, 6, seed=2)):
        want, _, _ = decode(target, prompt, 0, NgramProposer(), params=params)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 10)
        got, rounds, _ = decode(target, prompt, 4, InjectedNgram(earlier), params=params)
        same.append(got == want)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 0
    assert all(same) if advance == "per_position" else not all(same)


class InjectedMTPNgram(MTPNgramProposer):
    def __init__(self, earlier: list[int], *args):
        super().__init__(*args)
        self.ngram = InjectedNgram(earlier)

    def propose(self, context, depth):
        proposal = super().propose(context, depth)
        self.copied = getattr(self, "copied", 0) + (proposal is not None and not self.mtp.drafted)
        return proposal


def head_entries(target: Target, tokens: list[int]) -> list[KVCache]:
    """The head's cache after feeding it (t[i+1], trunk hidden i) for the whole sequence at once."""
    forward = target.trunk.forward(mx.array([tokens]), target.trunk.make_cache())
    cache = [KVCache() for _ in target.head.layers]
    target.head(target.trunk.embed(mx.array([tokens[1:]])), forward.hidden[:, :-1], cache)
    return cache


@pytest.mark.parametrize("whole_buffer", [False, True], ids=["stock", "whole_buffer"])
def test_mtp_ngram_equals_plain_greedy_and_keeps_the_head_in_step(target, whole_buffer, capsys,
                                                                  monkeypatch):  # fmt: skip
    """`whole_buffer`: the trunk's and the head's multi-row forwards through
    engines/kv_buffer.py's views, forced on here (the engines use them on CUDA)."""
    if target.head is None:
        pytest.skip("the dense tiny target has no MTP head")
    monkeypatch.setattr(target.trunk, "whole_buffer", whole_buffer)
    copied = heads = 0
    for i, prompt in enumerate(prompts(target.vocab, 8, seed=1)):
        want, margins = target.reference(prompt)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 12)
        proposer = InjectedMTPNgram(earlier, target.trunk, target.head, 2)
        got, rounds, decoder = decode(target, prompt, 6, proposer)
        assert_same_greedy(got, want, margins)
        copied += proposer.copied
        heads += sum(1 for r in rounds if r.drafted) - proposer.copied
        # Flush what the head is owed (one more draft of depth 1), then its
        # cache must be the whole sequence fed at once.
        context = decoder._context()
        proposer.mtp.propose(context, 1)
        want_cache = head_entries(target, decoder.tokens)
        for c, w in zip(proposer.mtp.cache, want_cache, strict=True):
            assert c.offset == w.offset == len(decoder.tokens) - 1
            for a, b in ((c.keys, w.keys), (c.values, w.values)):
                assert mx.allclose(a[..., : c.offset, :], b[..., : w.offset, :], atol=1e-4).item()
    assert copied > 0 and heads > 0
    with capsys.disabled():
        print(f"[{copied} copied rounds, {heads} head rounds]", end=" ")


# -- temperature > 0 ---------------------------------------------------------------

SAMPLED = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
N_SAMPLES = 6000


SMALL = dict(vocab_size=12, hidden_size=32, intermediate_size=64, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, tokenizer=False, seed=11)


@pytest.fixture(scope="module", params=["qwen35_hybrid", "qwen3_dense"])
def small(request, tmp_path_factory):
    """A 12-token target: every bigram has a real chance under top-k 5."""
    root = tmp_path_factory.mktemp("v12")
    if request.param == "qwen3_dense":
        path = build_qwen3_dense(root, **SMALL)
    else:
        path = build_qwen35_hybrid(root, linear_num_key_heads=1, linear_num_value_heads=2,
                                   linear_key_head_dim=16, linear_value_head_dim=16,
                                   with_mtp=False, **SMALL)  # fmt: skip
    target = Target(path, mtp=False)
    target.kind = request.param
    return target


def copy_prefix(model) -> list[int]:
    """Token 7 followed by every token t, then two more, and a final 7:
    whatever the prefill samples after it, the bigram (7, t) occurred and
    the round copies the two tokens that followed. Those two are set to the
    target's argmax after (..., 7, t), a few times over (each change moves
    the context), so the copies are likely tokens: a wrong rule shows where
    p(draft) is large."""
    follow = {t: [(t * 5 + 1) % 12, (t * 7 + 3) % 12] for t in range(12)}

    def prefix() -> list[int]:
        return [tok for t in range(12) for tok in (7, t, *follow[t])] + [7]

    def argmax(tokens: list[int]) -> int:
        return int(mx.argmax(model(mx.array([tokens]))[0, -1]).item())

    for _ in range(3):
        p = prefix()
        for t in range(12):
            a = argmax(p + [t])
            follow[t] = [a, argmax(p + [t, a])]
    return prefix()


def exact_pairs(model, prefix: list[int]) -> dict[tuple[int, int], float]:
    def dist(tokens):
        return probabilities(model(mx.array([tokens]))[0, -1], SAMPLED).tolist()

    return {(a, b): pa * pb for a, pa in enumerate(dist(prefix)) if pa > 0
            for b, pb in enumerate(dist(prefix + [a])) if pb > 0}  # fmt: skip


def redraw_from_p(draft, draft_probs, target_probs, key=None):
    """A slip: after a rejection, draw from p itself (the draft included)
    instead of from the residual, which favours the draft."""
    verdict = speculative.accept_sampled(draft, draft_probs, target_probs, key)
    j = verdict.accepted
    if j < len(draft):
        keys = mx.random.split(key) if key is not None else (None, None)
        token = int(mx.random.categorical(mx.log(target_probs[j]), key=keys[1]).item())
        return speculative.Verdict(j, token)
    return verdict


# 6000 seeded decodes: ~2 minutes on a quiet 2-core machine; the timeout is a
# hang guard, not a speed check.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("rule", ["point_mass", "wrong"])
def test_sampled_output_follows_the_target_distribution(small, rule, monkeypatch, capsys):
    """Bound: 3 x 0.5 sqrt(m/n), as in the MTP and DFlash tests. The wrong
    rule runs once (on the hybrid): the rule is the target's either way."""
    if rule == "wrong" and small.kind != "qwen35_hybrid":
        pytest.skip("the negative control runs on the hybrid")
    if rule == "wrong":
        monkeypatch.setattr(spec_decoder, "accept_sampled", redraw_from_p)
    n = N_SAMPLES if rule == "point_mass" else N_SAMPLES // 4
    prefix = copy_prefix(small.model)
    by_first: dict[int, Counter] = {}
    drafted = accepted = 0
    for seed in range(n):
        params = SamplingParams(**{**vars(SAMPLED), "seed": seed})
        got, rounds, _ = decode(small, prefix, 2, NgramProposer(), params=params, max_tokens=3)
        drafted += rounds[0].drafted
        accepted += sum(r.accepted for r in rounds)
        by_first.setdefault(got[0], Counter())[tuple(got[1:3])] += 1
    first, counts = max(by_first.items(), key=lambda kv: sum(kv[1].values()))
    m = sum(counts.values())
    exact = exact_pairs(small.model, prefix + [first])
    distance = 0.5 * sum(abs(counts[k] / m - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    bound = 3 * 0.5 * math.sqrt(len(exact) / m)
    with capsys.disabled():
        print(f"[{rule}: TV {distance:.4f}, bound {bound:.4f}, {len(exact)} outcomes, "
              f"{drafted} drafted, {accepted} accepted]", end=" ")
    assert drafted == 2 * n  # every first round copied two tokens
    if rule == "point_mass":
        assert accepted > 0 and set(counts) <= set(exact) and distance < bound
    else:
        assert distance > bound
