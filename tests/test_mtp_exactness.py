"""MTP speculative decoding equals plain greedy decoding, token for token.

On tiny checkpoints of every family (Qwen3.5 hybrid dense, Qwen3.5 MoE,
Qwen3-Next; float32) at depths 1..4, and on the trained demo model, where
the head's drafts are often accepted, so partial acceptance and the hybrid
rollback are exercised for real. Random heads are almost always rejected,
so for the tiny families a second run injects drafts (failure injection:
the head drafts as usual, then the test replaces its proposals with the
true continuation corrupted at a chosen position), forcing every
accepted-prefix length at every depth.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from engines.base import GenerationRequest, Plan, SamplingParams
from engines.builders.builtin_models import default_model_path
from engines.builders.tiny import build_qwen3_next, build_qwen35_hybrid, build_qwen35_moe
from engines.loading import LoadedModel
from engines.mlx_mtp.loading import load_mtp_head
from engines.prefix_cache import Hit, PrefixCache
from engines.proposers.base import Proposal
from engines.proposers.mtp import MTPProposer
from engines.spec_decoder import SpecDecoder
from engines.targets import target_for

BUILDERS = {"qwen35": build_qwen35_hybrid, "qwen35_moe": build_qwen35_moe, "qwen3_next": build_qwen3_next}
N_TOKENS = 64


def prompts(vocab: int, n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(rng.randint(1, 40))] for _ in range(n)]


class Target:
    """A float32 model with its trunk and MTP head, loaded here (not shared
    with a server), so the reference and the decoder see the same weights."""

    def reference(self, prompt: list[int], n: int = N_TOKENS):
        """Plain greedy decoding, computed once per prompt for all depths."""
        key = (tuple(prompt), n)
        if key not in self._references:
            self._references[key] = greedy_reference(self.model, prompt, n)
        return self._references[key]

    def __init__(self, path):
        self._references: dict = {}
        model, config = load_model(path)
        model.set_dtype(mx.float32)
        self.model = model
        self.loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
        self.trunk = target_for(model)
        self.head = load_mtp_head(self.loaded)
        self.head.set_dtype(mx.float32)
        self.vocab = self.loaded.vocab_size


@pytest.fixture(scope="module", params=list(BUILDERS))
def tiny(request, tmp_path_factory):
    return Target(BUILDERS[request.param](tmp_path_factory.mktemp(request.param), tokenizer=False))


def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))


@pytest.fixture(scope="module")
def demo():
    return Target(default_model_path())


class InjectedDrafts(MTPProposer):
    """Failure injection: the head drafts, then its proposals are replaced by
    the reference continuation with one token corrupted (or none)."""

    def __init__(self, *args, reference: list[int], rng: random.Random):
        super().__init__(*args)
        self.reference, self.rng = reference, rng

    def propose(self, context, depth):
        proposal = super().propose(context, depth)
        at = context.generated
        true = self.reference[at : at + depth]
        true += [0] * (depth - len(true))
        wrong = self.rng.randrange(depth + 1)  # depth: all drafts right
        if wrong < depth:
            true[wrong] = (true[wrong] + 1) % 7
        return Proposal(mx.array(true), proposal.q)


def decode(target: Target, prompt, depth, max_tokens=N_TOKENS, stop=frozenset(), cls=MTPProposer,
           prefix: PrefixCache | None = None, undo="tape", **inject):
    request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), max_tokens,
                                Plan("mlx_mtp", "mtp", depth, "spec_on"), stop)
    hit = prefix.fetch(prompt, drafter="mtp") if prefix else Hit(None, 0)
    decoder = SpecDecoder(target.trunk, cls(target.trunk, target.head, **inject), request,
                          hit.cache, hit.cached, None, undo=undo)
    if hit.drafter is not None:
        decoder.proposer.restore(hit.drafter)
    step = decoder.prefill()
    tokens, rounds = list(step.tokens), []
    while step.finish_reason is None:
        step = decoder.round(depth)
        tokens += step.tokens
        rounds.append(step.stats)
    if prefix is not None:
        prefix.insert(decoder.tokens[:-1], decoder.cache, drafter="mtp",
                      drafter_state=decoder.proposer.snapshot())
    return tokens, step.finish_reason, rounds


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_tiny_families_equal_plain_greedy(tiny, depth, capsys):
    ties = accepted = 0
    for i, prompt in enumerate(prompts(tiny.vocab)):
        want, margins = tiny.reference(prompt)
        got, finish, _ = decode(tiny, prompt, depth)
        ties += assert_same_greedy(got, want, margins)
        assert finish == "length" or ties
        # The same with drafts that are right up to a random position.
        got, _, rounds = decode(tiny, prompt, depth, cls=InjectedDrafts, reference=want,
                                rng=random.Random(i))
        ties += assert_same_greedy(got, want, margins)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 0  # partial and full acceptance really happened
    with capsys.disabled():
        print(f"[depth {depth}: {ties} near-tie divergence(s)]", end=" ")


def test_demo_model_equals_plain_greedy_with_real_acceptance(demo, capsys):
    texts = [
        "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
        "for i in range(10):\n", "    def __repr__(self):\n        return",
        "if __name__ == '__main__':\n", "def _check_arg(value, name):\n    if not isinstance(",
        "# Copyright", "try:\n    import _thread\nexcept ImportError:\n",
        "        raise ValueError(", "from collections import",
    ]
    tok_prompts = [demo_tokenizer().encode(t).ids for t in texts] + prompts(demo.vocab, 10, seed=1)
    ties, drafted, accepted = 0, 0, 0
    for depth in (1, 4):  # every depth: the tiny families and the counting test
        for prompt in tok_prompts:
            want, margins = demo.reference(prompt)
            got, _, rounds = decode(demo, prompt, depth)
            ties += assert_same_greedy(got, want, margins)
            drafted += sum(r.drafted for r in rounds)
            accepted += sum(r.accepted for r in rounds)
    assert accepted / drafted > 0.3, (accepted, drafted)
    with capsys.disabled():
        print(f"[demo: acceptance {accepted / drafted:.2f}, {ties} near-tie divergence(s)]", end=" ")


def test_counting_has_no_skipped_or_repeated_tokens(demo):
    tok = demo_tokenizer()
    prompt = tok.encode("numbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,").ids
    want, margins = demo.reference(prompt, 40)
    for depth in (1, 2, 3, 4):
        got, _, _ = decode(demo, prompt, depth, max_tokens=40)
        assert_same_greedy(got, want, margins)
        assert tok.decode(got) == tok.decode(want)


def test_eos_at_a_draft_position_stops_there(demo):
    prompt = prompts(demo.vocab, 1, seed=5)[0]
    want, _ = demo.reference(prompt)
    for depth in (2, 3, 4):
        for cut in (3, 10, 25):
            stop = frozenset({want[cut]})
            expected = want[: want.index(want[cut])]
            got, finish, rounds = decode(demo, prompt, depth, stop=stop, cls=InjectedDrafts,
                                         reference=want + [0] * depth, rng=random.Random(cut))
            assert (got, finish) == (expected, "stop")


def test_prefix_cache_seams(demo):
    """A cached prefix followed by drafting never yields a token the plain
    path would not: prompts that extend a cached sequence, and prompts that
    end in the middle of one."""
    prefix = PrefixCache("demo")
    base = prompts(demo.vocab, 1, seed=9)[0]
    first, _, _ = decode(demo, base, 3, max_tokens=24, prefix=prefix)
    extended = base + first + [5, 6, 7]
    middle = base + first[:10]
    reused = {}
    for name, prompt in (("extended", extended), ("middle", middle), ("base", base)):
        reused[name] = prefix.fetch(prompt).cached
        want, margins = greedy_reference(demo.model, prompt, 32)
        got, _, _ = decode(demo, prompt, 3, max_tokens=32, prefix=prefix)
        assert_same_greedy(got, want, margins)
    # The first run cached base + its output but the last token (never fed).
    assert reused["extended"] == len(base) + len(first) - 1


def test_replay_rollback_equals_capture_rollback(demo):
    """The two ways of undoing rejected drafts give the same output."""
    for prompt in prompts(demo.vocab, 4, seed=3):
        want, margins = demo.reference(prompt)
        for depth in (2, 4):
            got, _, _ = decode(demo, prompt, depth, undo="replay")
            assert_same_greedy(got, want, margins)
