"""MTP speculative decoding on the trained demo model, where the head is right often.

tests/test_exactness_greedy.py proves the MTP engine exact on tiny random
checkpoints of every family (Qwen3.5 hybrid dense, Qwen3.5 MoE, Qwen3-Next)
at every depth, with drafts injected to force every accepted length. Here,
on the shipped demo model (bfloat16, a trained head), acceptance is real, so
partial acceptance and the hybrid rollback run on the head's own drafts:
output equals plain greedy decoding; counting has no skipped or repeated
tokens; prompts that extend or cut a cached prefix decode the same; the
replay rollback equals the tape.
"""

from __future__ import annotations

import random

import pytest
from greedy import assert_same_greedy, greedy_reference
from tiny_targets import TinyTarget
from tokenizers import Tokenizer

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import Hit, PrefixCache
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.mlx_spec.decoder import SpecDecoder

N_TOKENS = 64


def prompts(vocab: int, n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))


@pytest.fixture(scope="module")
def demo():
    return TinyTarget(default_model_path(), head=True)


def decode(target: TinyTarget, prompt, depth, max_tokens=N_TOKENS, stop=frozenset(),
           prefix: PrefixCache | None = None, undo="tape"):  # fmt: skip
    request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), max_tokens,
                                Plan("mlx_mtp", "mtp", depth, "spec_on"), stop)
    hit = prefix.fetch(prompt, drafter="mtp") if prefix else Hit(None, 0)
    decoder = SpecDecoder(target.trunk, MTPProposer(target.trunk, target.head), request,
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


# The fast tier decodes the first 6 prompts (5 code, 1 random; each depth 3
# times), the proof tier all 12: the same claim, on more prompts.
@pytest.mark.parametrize("n", [6, pytest.param(12, marks=pytest.mark.proof)])
def test_demo_model_equals_plain_greedy_with_real_acceptance(demo, n, capsys):
    texts = [
        "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
        "for i in range(10):\n", "    def __repr__(self):\n        return",
        "if __name__ == '__main__':\n", "def _check_arg(value, name):\n    if not isinstance(",
        "# Copyright", "try:\n    import _thread\nexcept ImportError:\n",
        "        raise ValueError(", "from collections import",
    ]
    code = [demo_tokenizer().encode(t).ids for t in texts]
    random_ = prompts(demo.vocab, 2, seed=1)
    tok_prompts = (code[:5] + random_[:1] + code[5:] + random_[1:])[:n]
    ties, drafted, accepted = 0, 0, 0
    # Depths 1 and 4 take turns over the prompts (the tiny families and the
    # counting test see every depth).
    for i, prompt in enumerate(tok_prompts):
        depth = (1, 4)[i % 2]
        want, margins = demo.reference(prompt)
        got, _, rounds = decode(demo, prompt, depth)
        ties += assert_same_greedy(got, want, margins)
        drafted += sum(r.drafted for r in rounds)
        accepted += sum(r.accepted for r in rounds)
    assert accepted / drafted > 0.3, (accepted, drafted)
    with capsys.disabled():
        print(f"[demo, {n} prompts: acceptance {accepted / drafted:.2f}, {ties} near-tie "
              f"divergence(s)]", end=" ")


def test_counting_has_no_skipped_or_repeated_tokens(demo):
    tok = demo_tokenizer()
    prompt = tok.encode("numbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,").ids
    want, margins = demo.reference(prompt, 40)
    for depth in (1, 2, 3, 4):
        got, _, _ = decode(demo, prompt, depth, max_tokens=40)
        assert_same_greedy(got, want, margins)
        assert tok.decode(got) == tok.decode(want)


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
    for i, prompt in enumerate(prompts(demo.vocab, 2, seed=3)):
        want, margins = demo.reference(prompt)
        got, _, _ = decode(demo, prompt, (2, 4)[i % 2], undo="replay")
        assert_same_greedy(got, want, margins)
