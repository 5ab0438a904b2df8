"""What copying drafts from the context does beyond plain exactness (ngram, mtp+ngram).

tests/test_exactness_greedy.py and test_exactness_sampled.py prove the
ngram and mtp+ngram engines exact like every other (greedy at every depth,
sampled rounds against the target's law). Here, on tiny float32 targets,
dense (Qwen3: KV trim) and hybrid (Qwen3.5: GatedDeltaNet rollback), what
is particular to copies: copies cut short by measured evidence decode the
same; with sampling penalties each verify position is judged with the
penalties of the tokens before it, drafts included (a failure-injected
stale penalty must differ); and mtp+ngram keeps its MTP head in step
through copied rounds (its cache holds exactly what feeding it the whole
sequence at once gives), once more through whole KV buffers
(specgate/engines/forwards/kv_buffer.py). A second run injects a context (failure injection:
the index is handed a copy of the true continuation with every few tokens
corrupted, placed before the real context, so the real index finds long
matches and copies up to the next corruption).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy
from mlx_lm.models.cache import KVCache
from tiny_targets import TinyTarget

from specgate.builders.tiny import build_qwen3_dense, build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.mtp_ngram import MTPNgramProposer
from specgate.engines.drafting.ngram.copy_length import MIN_ROUNDS, CopyEvidence
from specgate.engines.drafting.ngram.index import NgramIndex
from specgate.engines.drafting.ngram.proposer import NgramProposer
from specgate.engines.mlx_spec import decoder as spec_decoder
from specgate.engines.mlx_spec.decoder import SpecDecoder

BUILDERS = {"qwen3_dense": build_qwen3_dense, "qwen35_hybrid": build_qwen35_hybrid}
N_TOKENS = 48


@pytest.fixture(scope="module", params=list(BUILDERS))
def target(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), tokenizer=False)
    return TinyTarget(path, head=request.param == "qwen35_hybrid")


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


def decode(target: TinyTarget, prompt, depth, proposer, params=None, max_tokens=N_TOKENS):
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


class RecordedEvidence(CopyEvidence):
    """CopyEvidence that also records each cut it made: (offered, kept)."""

    def __init__(self):
        super().__init__()
        self.cuts = []

    def length(self, match, offered):
        kept = super().length(match, offered)
        self.cuts.append((offered, kept))
        return kept


class ModeledCost(InjectedNgram):
    """Its rounds cost what the primed line below says, not what they took:
    the cuts then follow the evidence alone (a 2-core machine running the
    whole suite once timed rounds that moved every cut one way, and
    `test_copies_cut_by_evidence_decode_the_same` failed on it)."""

    def committed(self, last, drafts, accepted, forward):
        if self._timer.stop() is not None:  # (None: no copy was offered this round)
            self.evidence.observe(self._match, len(drafts), accepted, 0.013 + 0.004 * len(drafts))


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
        want, margins = target.reference(prompt, N_TOKENS)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 6)
        got, _, _ = decode(target, prompt, 4, ModeledCost(earlier, evidence))
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


def head_entries(target: TinyTarget, tokens: list[int]) -> list[KVCache]:
    """The head's cache after feeding it (t[i+1], trunk hidden i) for the whole sequence at once."""
    forward = target.trunk.forward(mx.array([tokens]), target.trunk.make_cache())
    cache = [KVCache() for _ in target.head.layers]
    target.head(target.trunk.embed(mx.array([tokens[1:]])), forward.hidden[:, :-1], cache)
    return cache


@pytest.mark.parametrize("whole_buffer", [False, True], ids=["stock", "whole_buffer"])
def test_mtp_ngram_equals_plain_greedy_and_keeps_the_head_in_step(target, whole_buffer, capsys,
                                                                  monkeypatch):  # fmt: skip
    """`whole_buffer`: the trunk's and the head's multi-row forwards through
    specgate/engines/forwards/kv_buffer.py's views, forced on here (the engines use them on CUDA)."""
    if target.head is None:
        pytest.skip("the dense tiny target has no MTP head")
    monkeypatch.setattr(target.trunk, "whole_buffer", whole_buffer)
    copied = heads = 0
    for i, prompt in enumerate(prompts(target.vocab, 8, seed=1)):
        want, margins = target.reference(prompt, N_TOKENS)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 12)
        proposer = InjectedMTPNgram(earlier, target.trunk, target.head, 2)
        got, rounds, decoder = decode(target, prompt, 6, proposer)
        assert_same_greedy(got, want, margins)
        copied += proposer.copied
        heads += sum(1 for r in rounds if r.drafted) - proposer.copied
        # Flush what the head is owed (one more draft of depth 1), then its
        # cache must be the whole sequence fed at once.
        context = decoder._context(None)
        proposer.mtp.propose(context, 1)
        want_cache = head_entries(target, decoder.tokens)
        for c, w in zip(proposer.mtp.cache, want_cache, strict=True):
            assert c.offset == w.offset == len(decoder.tokens) - 1
            for a, b in ((c.keys, w.keys), (c.values, w.values)):
                assert mx.allclose(a[..., : c.offset, :], b[..., : w.offset, :], atol=1e-4).item()
    assert copied > 0 and heads > 0
    with capsys.disabled():
        print(f"[{copied} copied rounds, {heads} head rounds]", end=" ")
