"""Greedy MTP rounds queued one ahead (engines/mlx_spec/ahead.py) give plain
greedy decoding's tokens, whatever is accepted, cut or switched.

The target is mlx-lm's qwen3 (dense attention: every cache a KVCache),
small and float32, with a bigram path (as bench/e2e_mtp_7b.py builds it):
the final hidden state points along the current token's embedding and
lm_head row sigma(t) is raised along it, so greedy decoding follows
t -> sigma(t) by a wide margin. The MTP head (one qwen3 block, its output
projections zeroed so it passes its input through) reads the next token's
embedding from its first half: with `noise` 0 it drafts the trunk's own
continuation (every draft accepted), with more it drafts wrong more often.
"""

from __future__ import annotations

import math
import random
import threading

import mlx.core as mx
import mlx.nn as nn
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.mtp.head import MTPHead
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.mlx_spec import ahead_round
from specgate.engines.mlx_spec.ahead import AheadDecoder
from specgate.engines.mlx_spec.ahead_round import CompiledRounds
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.targets import target_for

H, V = 64, 512
PROMPT = [7, 100, 31, 400, 5, 9, 250, 77]


@pytest.fixture(scope="module")
def trunk():
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=H, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, rms_norm_eps=1e-6, vocab_size=V,
                           max_position_embeddings=4096, rope_theta=1e4,
                           tie_word_embeddings=False)  # fmt: skip
    mx.random.seed(0)
    model = qwen3.Model(args)
    sigma = list(range(V))
    random.Random(0).shuffle(sigma)
    e = mx.random.normal((V, H), key=mx.random.key(1)) * 16.0
    unit = e / mx.linalg.norm(e, axis=-1, keepdims=True)
    inv = [0] * V
    for t, s in enumerate(sigma):
        inv[s] = t
    model.model.embed_tokens.weight = e
    model.lm_head.weight = model.lm_head.weight + (20.0 / math.sqrt(H)) * unit[mx.array(inv)]
    mx.eval(model.parameters())
    return model, args


def head(args, noise: float) -> MTPHead:
    mx.random.seed(2)
    h = MTPHead(H, args.rms_norm_eps, [qwen3.TransformerBlock(args)])
    block = h.layers[0]
    block.self_attn.o_proj.weight = mx.zeros_like(block.self_attn.o_proj.weight)
    block.mlp.down_proj.weight = mx.zeros_like(block.mlp.down_proj.weight)
    fc = mx.concatenate([mx.eye(H), noise * mx.random.normal((H, H))], axis=1)
    h.fc.weight = fc
    mx.eval(h.parameters())
    return h


def decode(model, mtp: MTPHead, depths, n: int, ahead: bool = True, stop=frozenset(),
           rounds: CompiledRounds | None = None, prompt=PROMPT):  # fmt: skip
    target = target_for(model)
    request = GenerationRequest("a", "a", prompt, SamplingParams(temperature=0), n,
                                Plan("mlx_mtp", "mtp", 3, "spec_on"), stop)  # fmt: skip
    args = (target, MTPProposer(target, mtp), request, None, 0, None)
    dec = AheadDecoder(*args, rounds=rounds) if ahead else SpecDecoder(*args)
    step = dec.prefill()
    tokens, rounds = list(step.tokens), []
    i = 0
    while step.finish_reason is None:
        step = dec.round(depths[i % len(depths)])
        i += 1
        tokens += step.tokens
        rounds.append(step.stats)
    return tokens, rounds, dec, step


@pytest.mark.parametrize("noise", [0.0, 0.25, 8.0])
@pytest.mark.parametrize("depths", [(1,), (4,), (3, 1, 4, 2)])
def test_ahead_rounds_give_plain_greedy_tokens(trunk, noise, depths):
    model, args = trunk
    n = 60
    want, margins = greedy_reference(model, PROMPT, n)
    tokens, rounds, dec, _ = decode(model, head(args, noise), depths, n)
    assert_same_greedy(tokens, want, margins)
    assert len(tokens) == n
    accepted = [r.accepted for r in rounds if r.drafted]
    if noise == 0.0:
        assert all(a == r.drafted for a, r in zip(accepted, rounds, strict=False) if r.drafted)
    if noise == 8.0:
        assert sum(accepted) <= len(accepted)  # mostly rejected
    # Ended: the caches are mlx-lm's again, holding every token but the last.
    assert all(type(c) is KVCache and c.offset == len(dec.tokens) - 1 for c in dec.cache)
    assert dec.proposer.cache[0].offset > 0 and type(dec.proposer.cache[0]) is KVCache


def test_partial_acceptance_happens_and_matches_the_decoder_round_for_round(trunk):
    model, args = trunk
    mtp = head(args, 0.25)
    tokens, rounds, _, _ = decode(model, mtp, (4,), 80)
    ref, ref_rounds, _, _ = decode(model, mtp, (4,), 80, ahead=False)
    assert tokens == ref
    counts = [r.accepted for r in rounds]
    assert counts == [r.accepted for r in ref_rounds]
    assert {0, 4} <= set(counts) and any(0 < c < 4 for c in counts), counts  # mixed rounds


def test_compiled_rounds_give_the_same_rounds_across_buffer_growth(trunk):
    """ahead_round.CompiledRounds: the same tokens and accepted counts as
    rounds built in Python, over 300 tokens (every buffer grows past 256:
    new traces), with depths that change, a depth-0 step and a cut."""
    model, args = trunk
    mtp = head(args, 0.25)
    rounds = CompiledRounds(target_for(model), mtp)
    prompt = [(i * 13 + 5) % V for i in range(120)]
    depths = (4, 4, 2, 0, 3, 1, 4)
    want, margins = greedy_reference(model, prompt, 300)
    got, got_rounds, dec, _ = decode(model, mtp, depths, 300, rounds=rounds, prompt=prompt)
    ref, ref_rounds, _, _ = decode(model, mtp, depths, 300, prompt=prompt)
    assert_same_greedy(got, want, margins)
    assert got == ref
    assert [r.accepted for r in got_rounds] == [r.accepted for r in ref_rounds]
    assert all(c.offset == len(dec.tokens) - 1 for c in dec.cache)
    assert len({key[0] for key in rounds._compiled}) == 4  # depths 1..4 compiled
    # A cut inside a round, and EOS, on traces already made.
    for n in (17, 19):
        cut, _, dec, step = decode(model, mtp, (4,), n, rounds=rounds, prompt=prompt)
        assert cut == want[:n] and step.finish_reason == "length"
        assert all(c.offset == len(dec.tokens) - 1 for c in dec.cache)


class _Counted(CompiledRounds):
    """The compiled rounds, counting the rounds that ran uncompiled while
    their kernels were built (instrumentation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.uncompiled: list[int] = []

    def __call__(self, k, *args, **kwargs):
        r = super().__call__(k, *args, **kwargs)
        if r is None:
            self.uncompiled.append(k)
        return r


def test_rounds_run_uncompiled_while_their_kernels_are_built_then_compiled(trunk):
    """warm_first (the engine's on a GPU): a depth's first rounds run
    uncompiled while a thread builds its trace's kernels, under the given
    lock; then that depth's rounds are compiled. Every token is plain
    greedy's and every round the same as rounds built in Python."""
    model, args = trunk
    mtp = head(args, 0.25)
    traced = []

    class Lock:  # the engine's model lock, as the warm-up takes it (instrumentation)
        def __enter__(self):
            traced.append(threading.current_thread().name)

        def __exit__(self, *exc):
            return False

    rounds = _Counted(target_for(model), mtp, warm_first=True, warm_lock=Lock())
    prompt = [(i * 13 + 5) % V for i in range(40)]
    depths = (4, 4, 2, 3, 4)
    want, margins = greedy_reference(model, prompt, 120)
    got, got_rounds, _, _ = decode(model, mtp, depths, 120, rounds=rounds, prompt=prompt)
    ref, ref_rounds, _, _ = decode(model, mtp, depths, 120, prompt=prompt)
    assert_same_greedy(got, want, margins)
    assert got == ref and [r.accepted for r in got_rounds] == [r.accepted for r in ref_rounds]
    assert rounds.built_first.wait(300)
    # Each depth's first BUILD_AT_CALL calls at least (its build starts at that one).
    assert all(rounds.uncompiled.count(k) >= ahead_round.BUILD_AT_CALL for k in (2, 3, 4)), rounds.uncompiled
    # One build per depth, each traced under the lock on its own thread.
    assert sorted(key[0] for key in rounds.built_first._threads) == [2, 3, 4]
    assert len(traced) == 3 and all(name.startswith("round-build") for name in traced)
    # Built: the next request's rounds are all compiled, and still exact.
    rounds.uncompiled.clear()
    again, _, _, _ = decode(model, mtp, depths, 120, rounds=rounds, prompt=prompt)
    assert again == ref and not rounds.uncompiled
    assert {key[0] for key in rounds._compiled} == {2, 3, 4}


def test_depth_zero_and_cuts_hand_back_to_the_decoder_exactly(trunk):
    model, args = trunk
    mtp = head(args, 0.25)
    want, margins = greedy_reference(model, PROMPT, 70)
    tokens, rounds, _, _ = decode(model, mtp, (3, 3, 0, 2, 4, 0, 0, 1), 70)
    assert_same_greedy(tokens, want, margins)
    assert [r.drafted for r in rounds[:4]] == [3, 3, 0, 2]
    # max_tokens cuts inside a round; EOS cuts and is not part of the text
    for n in (17, 18, 19):
        got, _, dec, step = decode(model, mtp, (4,), n)
        assert got == want[:n] and step.finish_reason == "length"
        assert all(c.offset == len(dec.tokens) - 1 for c in dec.cache)
    stop = want[30]
    got, _, dec, step = decode(model, mtp, (4,), 70, stop=frozenset({stop}))
    assert got == want[: want.index(stop)] and step.finish_reason == "stop"
    assert all(c.offset == len(dec.tokens) - 1 for c in dec.cache)


def test_a_handoff_after_ahead_rounds_carries_the_exact_state(trunk):
    model, args = trunk
    mtp = head(args, 0.25)
    target = target_for(model)
    request = GenerationRequest("h", "h", PROMPT, SamplingParams(temperature=0), 50,
                                Plan("mlx_mtp", "mtp", 3, "spec_on"))  # fmt: skip
    dec = AheadDecoder(target, MTPProposer(target, mtp), request, None, 0, None)
    tokens = list(dec.prefill().tokens)
    for _ in range(4):
        tokens += dec.round(3).tokens
    handoff = dec.handoff(Plan("mlx_plain", "none", 0, "concurrency"), None)
    assert handoff.tokens == PROMPT + tokens
    assert all(c.offset == len(handoff.tokens) - 1 for c in handoff.cache)
    # the plain continuation from the handed-over cache is greedy's
    want, _ = greedy_reference(model, PROMPT, len(tokens) + 10)
    y, rest = mx.array([[handoff.tokens[-1]]]), []
    for _ in range(10):
        y = mx.argmax(model(y, cache=handoff.cache)[:, -1:], axis=-1)
        rest.append(y.item())
    assert tokens + rest == want


@pytest.mark.parametrize("compiled", [False, True])
def test_a_sequence_handed_over_from_plain_decoding_queues_ahead_exactly(trunk, compiled):
    """A plain engine's sequence resumed here: its head has never run (an
    empty cache), the first round is a plain step, and the rounds queued
    ahead begin once the head has drafted (an H100 run crashed entering
    them with the head's cache still empty)."""
    from specgate.engines.base import Handoff

    model, args = trunk
    mtp = head(args, 0.25)
    target = target_for(model)
    want, margins = greedy_reference(model, PROMPT, 60)
    cache = target.make_cache()
    model(mx.array([PROMPT + want[:9]]), cache=cache)  # plain decoding's cache: tokens[:-1]
    mx.eval([c.state for c in cache])
    tokens = PROMPT + want[:10]
    handoff = Handoff(Plan("mlx_mtp", "mtp", 3, "spec_on"), tokens, 10, cache, None, pending=[want[9]])
    request = GenerationRequest("r", "r", PROMPT, SamplingParams(temperature=0), 60,
                                Plan("mlx_mtp", "mtp", 3, "spec_on"))  # fmt: skip
    rounds = CompiledRounds(target, mtp) if compiled else None
    dec = AheadDecoder(target, MTPProposer(target, mtp), request, cache, len(tokens) - 1, None,
                       rounds=rounds)  # fmt: skip
    step = dec.resume(handoff)
    got = list(step.tokens)
    drafted = 0
    while step.finish_reason is None:
        step = dec.round(3)
        got += step.tokens
        drafted += step.stats.drafted
    assert drafted > 0
    assert_same_greedy(want[:9] + got, want, margins)


def test_fits_only_where_it_is_exact(trunk):
    model, args = trunk
    target = target_for(model)
    proposer = MTPProposer(target, head(args, 0.0))

    def req(**kw):
        return GenerationRequest("f", "f", PROMPT, SamplingParams(**kw), 8,
                                 Plan("mlx_mtp", "mtp", 3, "spec_on"))  # fmt: skip

    assert AheadDecoder.fits(target, proposer, req(temperature=0), None)
    assert not AheadDecoder.fits(target, proposer, req(temperature=0.7, seed=1), None)
    assert not AheadDecoder.fits(target, proposer, req(temperature=0, presence_penalty=0.5), None)
    assert not AheadDecoder.fits(target, proposer, req(temperature=0, logprobs=True), None)
    assert not AheadDecoder.fits(target, proposer, req(temperature=0), object())  # a grammar


def test_the_demo_model_a_hybrid_with_a_trained_head_decodes_ahead_exactly():
    """Qwen3.5's layout (GatedDeltaNet beside attention: the recurrent state
    after the accepted steps is picked on the device) and a head whose
    drafts are right often, so partial acceptance is the head's own."""
    from test_mtp_exactness import demo_tokenizer
    from tiny_targets import TinyTarget

    from specgate.engines.checkpoints.builtin import default_model_path

    demo = TinyTarget(default_model_path(), head=True)
    tok = demo_tokenizer()
    drafted = accepted = 0
    for i, text in enumerate(["import os\nimport sys\n\n\ndef main():\n",
                              "class Stack:\n    def __init__(self):\n",
                              "numbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"]):  # fmt: skip
        prompt = tok.encode(text).ids
        want, margins = demo.reference(prompt, 48)
        request = GenerationRequest("d", "d", prompt, SamplingParams(temperature=0), 48,
                                    Plan("mlx_mtp", "mtp", 3, "spec_on"))  # fmt: skip
        dec = AheadDecoder(demo.trunk, MTPProposer(demo.trunk, demo.head), request, None, 0, None)
        step = dec.prefill()
        tokens = list(step.tokens)
        while step.finish_reason is None:
            step = dec.round((1, 3, 4)[i])
            tokens += step.tokens
            drafted += step.stats.drafted
            accepted += step.stats.accepted
        assert_same_greedy(tokens, want, margins)
        assert all(c.offset == len(dec.tokens) - 1 for c in dec.cache if isinstance(c, KVCache))
    assert accepted / drafted > 0.3, (accepted, drafted)


def test_the_mtp_engine_serves_ahead_and_its_prefix_cache_entry_resumes_exactly():
    """Through SpecEngine (its rounds, the end of a request, the prefix
    cache entry it leaves: the caches and the head's state after the last
    round read), on the demo model, ahead forced on as on a GPU."""
    import asyncio

    from test_mtp_exactness import demo_tokenizer

    from specgate.engines.base import CacheSettings, TokenEvent
    from specgate.engines.checkpoints.builtin import default_model_path
    from specgate.engines.drafting.mtp import proposer as mtp
    from specgate.engines.loading import load_mlx_model
    from specgate.engines.mlx_spec.engine import SpecEngine
    from specgate.policies.decide import FixedPlanner

    loaded = load_mlx_model(str(default_model_path()), CacheSettings(disk_bytes=0))
    tok = demo_tokenizer()
    first = tok.encode("def main():\n    for i in range(10):\n").ids
    more = tok.encode("\n# and then\n").ids
    plan = Plan("mlx_mtp", "mtp", 3, "spec_on")

    async def run(engine, prompt):
        request = GenerationRequest(f"r{len(prompt)}", "demo", prompt,
                                    SamplingParams(temperature=0), 40, plan, cache_scope="t")  # fmt: skip
        tokens, cached = [], 0
        async for ev in engine.generate(request, FixedPlanner(plan)):
            if isinstance(ev, TokenEvent):
                tokens += ev.token_ids
                cached = ev.cached_tokens
        return tokens, cached

    async def main():
        engine = SpecEngine("demo", loaded, name="mlx_mtp", drafting=mtp.drafting,
                            max_context=4096, kernels="off")  # fmt: skip
        engine.ahead = True
        await engine.start()
        try:
            a = await run(engine, first)
            b = await run(engine, first + a[0] + more)  # the next turn: resumes from a's entry
            return a, b
        finally:
            await engine.stop()

    (a, _), (b, cached) = asyncio.run(asyncio.wait_for(main(), 120))
    for prompt, got in ((first, a), (first + a + more, b)):
        want, margins = greedy_reference(loaded.model, prompt, 40)
        assert_same_greedy(got, want, margins)
    # The second found the first's entry: its caches and head state as the
    # last round read left them (a hybrid's entry is whole: every token but the last).
    assert cached == len(first) + len(a) - 1


def test_a_compiled_round_never_records_the_way_round_an_unbuilt_tile(trunk):
    """A trace keeps the branch it took: traced while MLX's tile for the
    verify rows was not built (kernels/tiles.py, a watch that never says
    ready: failure injection), a replayed round would stay on the way
    round for good. CompiledRounds traces under tiles.stock(): the watch is
    asked about the prefill, never about the 8 verify rows of depth 7."""
    from mlx.utils import tree_map

    from specgate.kernels import hook as kernel_hook
    from specgate.kernels.tiles import TileWatch

    model, args = trunk
    quantized = qwen3.Model(args)
    quantized.update(tree_map(lambda a: a, model.parameters()))
    nn.quantize(quantized, group_size=64, bits=4)
    asked = []

    class Never(TileWatch):
        def ready(self, rows, dtype, bits, group_size):
            asked.append(rows)
            return False

    kernel_hook.watch_tiles(quantized, Never(set, threading.Event()))
    mtp = head(args, 0.0)
    prompt = [(i * 13 + 5) % V for i in range(20)]
    want, margins = greedy_reference(quantized, prompt, 24)
    asked.clear()
    got, rounds, _, _ = decode(quantized, mtp, (7,), 24, rounds=CompiledRounds(target_for(quantized), mtp),
                               prompt=prompt)  # fmt: skip
    assert_same_greedy(got, want, margins)
    assert asked and set(asked) == {20}  # the prefill's products only
