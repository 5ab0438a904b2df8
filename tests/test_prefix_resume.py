"""Decoding from a prefix-cache snapshot is decoding from scratch.

Two prompts share a prefix (a system prompt) and differ after it. The first
is decoded with a snapshot kept at the boundary, as the engines keep them
(specgate/engines/mlx_spec/engine.py); the second then resumes from that snapshot, the
trunk's caches and the drafter's state (MTP head, DFlash and DSpark
drafters) restored, and feeds only its own tokens. A cold run of the second
prompt, prefilled in the same two chunks so the arithmetic is the same,
must give the same tokens and the same drafts in every round: the drafter
resumed exactly where it was, not blind. A control resumes the trunk alone
(the drafter blind to the prefix): the output is still exact, but its drafts
differ, so the equality above is not an accident.

Hybrid targets throughout (GatedDeltaNet state, which cannot be cut back:
the snapshot is the only way to reuse the prefix), and the shipped demo
with its trained MTP head and DFlash drafter.
"""

from __future__ import annotations

import random

import pytest
from tiny_targets import TinyTarget

from specgate.builders.drafters import build_dflash_drafter, build_dspark_drafter
from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import CacheBudget, Hit, PrefixCache, snapshot
from specgate.engines.checkpoints.builtin import default_model_path, demo_dflash_path
from specgate.engines.drafting.dflash.model import check_pairing, load_dflash
from specgate.engines.drafting.dflash.proposer import DFlashProposer
from specgate.engines.drafting.dspark.model import load_dspark
from specgate.engines.drafting.dspark.proposer import DSparkProposer
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.mlx_spec.decoder import SpecDecoder

N_TOKENS = 40
DEPTH = 3


class Recording:
    """Wraps a proposer: every round's drafts, as lists."""

    def __init__(self, proposer):
        self.inner, self.drafts = proposer, []
        self.method, self.layers = proposer.method, proposer.layers

    def propose(self, context, depth):
        proposal = self.inner.propose(context, depth)
        self.drafts.append(None if proposal is None else proposal.drafts.tolist())
        return proposal

    def __getattr__(self, name):
        return getattr(self.inner, name)


def decode(trunk, proposer, prompt, boundary, prefix=None, drafter_id="d", restore=True):
    """(tokens, drafts per round, tokens resumed from the cache)."""
    request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), N_TOKENS,
                                Plan("e", proposer.method, DEPTH, "spec_on"))  # fmt: skip
    hit = prefix.fetch(prompt, "k", drafter_id) if prefix is not None else Hit(None, 0)
    recording = Recording(proposer)
    decoder = SpecDecoder(trunk, recording, request, hit.cache, hit.cached, None)
    if hit.drafter is not None and restore:
        proposer.restore(hit.drafter)
    cuts = [boundary] if hit.cached < boundary else []
    for fed in decoder.prefill_chunks(cuts):
        if prefix is not None and fed in cuts:  # as the engines keep a snapshot
            prefix.insert(prompt[:fed], snapshot(decoder.cache), "k", drafter=drafter_id,
                          drafter_state=proposer.snapshot())  # fmt: skip
    step = decoder.first_token()
    tokens = list(step.tokens)
    while step.finish_reason is None:
        step = decoder.round(DEPTH)
        tokens += step.tokens
    return tokens, recording.drafts, hit.cached


def shared_prompts(vocab: int, seed: int) -> tuple[list[int], list[int], int]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab - 3) for _ in range(70)]
    first = system + [rng.randrange(vocab - 3) for _ in range(9)]
    second = system + [rng.randrange(vocab - 3) for _ in range(13)]
    return first, second, len(system)


def tiny_hybrid(root):
    return build_qwen35_hybrid(root / "target", tokenizer=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    target = tiny_hybrid(root)
    dflash = build_dflash_drafter(root / "dflash", target=target, block_size=5,
                                  num_hidden_layers=2, tokenizer=False)  # fmt: skip
    dspark = build_dspark_drafter(root / "dspark", target=target, block_size=5,
                                  num_hidden_layers=2, tokenizer=False)  # fmt: skip
    mtp = TinyTarget(target, head=True)
    return {
        "mtp": (mtp.trunk, lambda: MTPProposer(mtp.trunk, mtp.head), mtp.vocab),
        "dflash": block(target, dflash, load_dflash, DFlashProposer),
        "dspark": block(target, dspark, load_dspark, DSparkProposer),
    }


def block(target, drafter, loader, cls):
    t = TinyTarget(target, drafter=drafter, loader=loader, pairing=check_pairing)
    return t.trunk, lambda: cls(t.trunk, t.drafter), t.vocab


@pytest.fixture(scope="module")
def demo():
    mtp = TinyTarget(default_model_path(), head=True)
    drafter = load_dflash(demo_dflash_path())
    return {
        "mtp": (mtp.trunk, lambda: MTPProposer(mtp.trunk, mtp.head), mtp.vocab),
        "dflash": (mtp.trunk, lambda: DFlashProposer(mtp.trunk, drafter), mtp.vocab),
    }


def check_resume(trunk, make, vocab, seed):
    first, second, boundary = shared_prompts(vocab, seed)
    cold, cold_drafts, _ = decode(trunk, make(), second, boundary)
    prefix = PrefixCache("m", trimmable=False, budget=CacheBudget(1 << 40))
    decode(trunk, make(), first, boundary, prefix)
    warm, warm_drafts, resumed = decode(trunk, make(), second, boundary, prefix)
    assert resumed == boundary  # only the second prompt's own tokens were prefilled
    assert warm == cold
    assert warm_drafts == cold_drafts
    blind, blind_drafts, _ = decode(trunk, make(), second, boundary, prefix, restore=False)
    assert blind == cold  # exact either way
    return blind_drafts != cold_drafts


@pytest.mark.parametrize("method", ["mtp", "dflash", "dspark"])
def test_tiny_hybrid_resumes_trunk_and_drafter_from_a_snapshot(tiny, method):
    differs = [check_resume(*tiny[method], seed=s) for s in range(3)]
    assert any(differs)  # the control: a blind drafter drafts otherwise


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_demo_resumes_with_its_trained_drafters(demo, method):
    assert check_resume(*demo[method], seed=11)


def test_an_identical_retry_feeds_one_token(tiny):
    """The prompt but its last token is kept: a retry prefills one token."""
    trunk, make, vocab = tiny["mtp"]
    prompt, _, _ = shared_prompts(vocab, 5)
    prefix = PrefixCache("m", trimmable=False, budget=CacheBudget(1 << 40))
    first, _, _ = decode(trunk, make(), prompt, len(prompt) - 1, prefix)
    again, _, resumed = decode(trunk, make(), prompt, len(prompt) - 1, prefix)
    assert (again, resumed) == (first, len(prompt) - 1)
