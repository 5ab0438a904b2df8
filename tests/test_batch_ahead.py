"""A batch's greedy MTP rounds queued one ahead (specgate/engines/mlx_spec/batch_ahead.py).

On tests/test_ahead.py's bigram trunk (dense qwen3; its MTP head drafts the
trunk's continuation, wrong more often with `noise`), AheadDecoders in one
BatchSpecDecoder(ahead=True) with prompts and lengths of their own: the
batch runs ahead at each stream's depth (a mixed round's plain stream
accepts nothing), and drops the round queued ahead for a zero depth, a
join, a leave and a stream that ends. Each stream's tokens equal its
plain greedy decoding, and with a head that drafts the trunk's own text
(from the last pair it is fed) every draft stands, through every switch.
On the demo model (a Qwen3.5 hybrid:
each row's recurrent state kept from the tape, and restored when a round
is dropped; a trained head that reads its own cache) at depths that stay
put, the rounds run ahead accept what the ordinary batch's accept, round
for round. Compiled batched rounds (CompiledBatchRounds, with a head whose attention
reads its cache) give the rounds built in Python across buffer growth.
And through SpecEngine with concurrent requests.
"""

from __future__ import annotations

import asyncio
import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.models.cache import ArraysCache, KVCache
from test_ahead import head as bigram_head
from test_ahead import trunk  # noqa: F401  (the bigram trunk fixture)

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.mlx_spec import ahead_round
from specgate.engines.mlx_spec.ahead import AheadDecoder
from specgate.engines.mlx_spec.batch_ahead import CompiledBatchRounds
from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder
from specgate.engines.targets import target_for

GREEDY = SamplingParams(temperature=0)
# Each round's depth for every stream; "mixed": s1 plain, the others at 3;
# "uneven": s1 at 1, the others at 3.
SCHEDULE = [3, 3, 3, 2, 2, 0, 4, 4, "mixed", 4, "mixed", "mixed", 1, 3, 3, 3, 2, 4, 4, "uneven", 4, 4, 4, 4, 4, 4]


def run(model, mtp, prompts: dict[str, list[int]], lengths: dict[str, int], ahead: bool,
        schedule: list = SCHEDULE, rounds: CompiledBatchRounds | None = None):  # fmt: skip
    """s0-s2 decode from the start, s3 joins at round 4, s2 leaves at round
    9 and ends alone; each stream ends at its own length. Returns each
    stream's tokens, each round's (accepted, drafted) counts, and how many
    rounds ran ahead."""
    target = target_for(model)
    batch = BatchSpecDecoder(target, ahead=ahead, rounds=rounds and (lambda head: rounds))
    decoders, out, counts, ran_ahead = {}, {}, [], 0

    def start(key: str) -> None:
        request = GenerationRequest(key, "m", prompts[key], GREEDY, lengths[key],
                                    Plan("mlx_mtp", "mtp", 3, "spec_on"))  # fmt: skip
        d = AheadDecoder(target, MTPProposer(target, mtp), request, None, 0, None)
        out[key] = list(d.prefill().tokens)
        decoders[key] = d
        batch.join(key, d)

    for key in ("s0", "s1", "s2"):
        start(key)
    for i, k in enumerate(schedule * 3):
        if not batch.decoders:
            break
        if i == 4:
            start("s3")
        if i == 9 and "s2" in batch.decoders:
            alone = batch.leave("s2")
            step = None
            while step is None or step.finish_reason is None:
                step = alone.round(2)
                out["s2"] += step.tokens
        uneven = {"mixed": 0, "uneven": 1}
        depths = {key: (uneven[k] if key == "s1" else 3) if k in uneven else k for key in batch.decoders}
        steps = batch.round(depths)
        ran_ahead += batch._ahead is not None
        counts.append({key: (s.stats.accepted, s.stats.drafted) for key, s in steps.items()})
        for key, step in steps.items():
            out[key] += step.tokens
            assert len(step.tokens) <= step.stats.drafted + 1  # no more than its asked depth stands
            if step.finish_reason is not None:
                d = batch.leave(key)
                # back as the decoder's own: mlx-lm caches holding all its tokens but the last
                assert all(type(c) is ArraysCache or type(c) is KVCache and c.offset == len(d.tokens) - 1
                           for c in d.cache)  # fmt: skip
                assert type(d.proposer.cache[0]) is KVCache and d.proposer.cache[0].offset > 0
    assert not batch.decoders
    return out, counts, ran_ahead


@pytest.mark.parametrize("noise", [0.0, 0.25])
def test_batched_rounds_run_ahead_and_each_stream_decodes_as_plain_greedy(trunk, noise):  # noqa: F811
    model, args = trunk
    rng = random.Random(4)
    vocab = model.args.vocab_size
    prompts = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate((3, 12, 8, 5))}
    lengths = {"s0": 70, "s1": 45, "s2": 60, "s3": 33}
    got, counts, ran_ahead = run(model, bigram_head(args, noise), prompts, lengths, ahead=True)
    for key, prompt in prompts.items():
        want, margins = greedy_reference(model, prompt, lengths[key])
        assert_same_greedy(got[key], want, margins)
        assert len(got[key]) == lengths[key]
    assert ran_ahead >= 15
    every = [c for r in counts for c in r.values() if c[1]]
    if noise == 0.0:  # the head drafts the trunk's text: with its state right, every draft stands
        assert all(a == d for a, d in every), counts
    else:
        assert {0, 4} <= {a for a, _ in every} and any(0 < a < d for a, d in every)  # mixed verdicts


@pytest.mark.parametrize("warm_first", [False, True])
def test_compiled_batched_rounds_give_the_same_rounds_across_buffer_growth(trunk, warm_first,  # noqa: F811
                                                                          monkeypatch):  # fmt: skip
    """CompiledBatchRounds: the same tokens and accepted counts as batched
    rounds built in Python, with streams whose caches grow past 256
    columns (new traces), depths that change, joins, leaves and ends. The
    head's attention is switched on (its output projection random), so
    its drafts read its own cache: a wrong offset or row shows. warm_first
    (the engine's on a GPU): a shape's rounds run uncompiled until a thread
    built its kernels, then compiled; a second run of the same batches is
    compiled throughout, and still the same (each shape's build from its
    first call here: some shapes come only once or twice a run)."""
    monkeypatch.setattr(ahead_round, "BUILD_AT_CALL", 1)
    model, args = trunk
    mtp = bigram_head(args, 0.25)
    o_proj = mtp.layers[0].self_attn.o_proj
    o_proj.weight = 0.5 * mx.random.normal(o_proj.weight.shape, key=mx.random.key(3))
    rng = random.Random(5)
    vocab = model.args.vocab_size
    prompts = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate((120, 30, 200, 9))}
    lengths = {"s0": 150, "s1": 90, "s2": 80, "s3": 60}
    rounds = CompiledBatchRounds(target_for(model), mtp, warm_first=warm_first)
    got, counts, ran_ahead = run(model, mtp, prompts, lengths, True, rounds=rounds)
    ref, ref_counts, _ = run(model, mtp, prompts, lengths, True)
    assert got == ref and counts == ref_counts
    if warm_first:
        assert rounds.built_first.wait(300)
        built = set(rounds.built_first._threads)
        assert len(built) >= 4  # (depth, batch) shapes
        again, again_counts, _ = run(model, mtp, prompts, lengths, True, rounds=rounds)
        assert again == ref and again_counts == ref_counts
        assert set(rounds.built_first._threads) == built  # no new shape: every round compiled
    assert ran_ahead >= 30 and len(rounds._compiled) >= 4  # (depth, batch) shapes traced
    for key, prompt in prompts.items():
        want, margins = greedy_reference(model, prompt, lengths[key])
        assert_same_greedy(got[key], want, margins)


def test_the_demo_hybrid_s_batch_runs_ahead_exactly_with_its_head_s_own_drafts():
    """The demo model: Qwen3.5's layout (each row's recurrent state kept
    from the tape, and restored when a round is dropped) and a trained MTP
    head whose attention reads its own cache. At depths that stay put (one
    stream at 1, the others at 3, in one round) the rounds run ahead draft
    what the ordinary batch's rounds draft, round for round, through joins,
    leaves and ends: each stream's head cache and owed pairs go in and come
    out as ordinary rounds keep them. (A depth that changes reaches a round
    run ahead one round later than an ordinary one.)"""
    from test_mtp_exactness import demo_tokenizer
    from tiny_targets import TinyTarget

    from specgate.engines.checkpoints.builtin import default_model_path

    demo = TinyTarget(default_model_path(), head=True)
    tok = demo_tokenizer()
    texts = ["import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
             "numbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", "for i in range(10):\n    print("]  # fmt: skip
    prompts = {f"s{i}": tok.encode(t).ids for i, t in enumerate(texts)}
    lengths = {"s0": 40, "s1": 30, "s2": 36, "s3": 24}
    schedule = ["uneven"] * 26
    got, counts, ran_ahead = run(demo.model, demo.head, prompts, lengths, True, schedule)
    _, ref_counts, _ = run(demo.model, demo.head, prompts, lengths, False, schedule)
    for key, prompt in prompts.items():
        want, margins = demo.reference(prompt, lengths[key])
        assert_same_greedy(got[key], want, margins)
    assert ran_ahead >= 10
    assert counts == ref_counts
    accepted = sum(a for r in counts for a, _ in r.values())
    assert accepted > 0.3 * sum(d for r in counts for _, d in r.values())


def test_the_engine_runs_concurrent_requests_ahead_in_one_batch(trunk):  # noqa: F811
    """Through SpecEngine.generate() with ahead and compiled rounds forced
    on (as on a GPU): five concurrent greedy MTP requests decode in one
    batch whose rounds run ahead, one client goes away after 12 tokens,
    and each of the others equals its plain greedy decoding (the one that
    left, up to where it left)."""
    from test_batch_engine import _Ids, collect

    from specgate.engines.cache.prefix_cache import PrefixCache
    from specgate.engines.drafting.base import Drafting
    from specgate.engines.loading import LoadedModel
    from specgate.engines.mlx_spec.engine import SpecEngine
    from specgate.policies.decide import FixedPlanner

    model, args = trunk
    mtp = bigram_head(args, 0.25)
    vocab = model.args.vocab_size
    rng = random.Random(8)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (6, 9, 4, 12, 7)]
    leaves = {4: 12}  # request 4's client goes away after 12 tokens
    plan = Plan("mlx_mtp", "mtp", 3, "forced_by_request")
    loaded = LoadedModel("bigram", model, _Ids(), {"model_type": "qwen3", "vocab_size": vocab},
                         PrefixCache("bigram", 0))  # fmt: skip
    ahead_rounds, engine_rounds = [], []

    class Batch(BatchSpecDecoder):  # counts the rounds that ran ahead
        def round(self, depths):
            steps = super().round(depths)
            ahead_rounds.append(self._ahead is not None)
            return steps

    def drafting(loaded, target, drafter=None, settings=None):
        return Drafting("mtp", lambda t: MTPProposer(t, mtp), weights=mtp, kernel_module=mtp)

    async def main():
        engine = SpecEngine("bigram", loaded, name="mlx_mtp", drafting=drafting, max_context=4096,
                            kernels="off", prefill_step_size=16)  # fmt: skip
        engine.ahead, engine.compiled_rounds, engine.batch_decoder = True, True, Batch
        engine_rounds.append(engine._batch_rounds_for(mtp))
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, GenerationRequest(f"r{i}", "bigram", p, GREEDY, 50, plan),
                                                  FixedPlanner(plan), leaves.get(i)) for i, p in enumerate(prompts)))  # fmt: skip
        finally:
            await engine.stop()

    outs = asyncio.run(asyncio.wait_for(main(), 120))
    for i, (prompt, (got, _, _)) in enumerate(zip(prompts, outs, strict=True)):
        want, margins = greedy_reference(model, prompt, 50)
        if i in leaves:
            assert leaves[i] <= len(got) < 50
            want, margins = want[: len(got)], margins[: len(got)]
        assert_same_greedy(got, want, margins)
    assert max(s.batch for _, stats, _ in outs for s in stats) >= 3
    assert sum(ahead_rounds) >= 10, ahead_rounds
    assert engine_rounds and engine_rounds[0]._compiled  # the batch's rounds ran compiled


def test_stopping_the_engine_waits_for_a_round_build_in_flight(trunk):  # noqa: F811
    """A compiled round's build (ahead_round.BuiltFirst) is one MLX
    evaluation on its own thread: SpecEngine.stop waits for it (bounded),
    so no thread of a stopped engine still runs MLX work as a process exits."""
    import threading
    import time

    from test_batch_engine import _Ids

    from specgate.engines.cache.prefix_cache import PrefixCache
    from specgate.engines.drafting.base import Drafting
    from specgate.engines.loading import LoadedModel
    from specgate.engines.mlx_spec.engine import SpecEngine

    model, args = trunk
    mtp = bigram_head(args, 0.25)
    loaded = LoadedModel("bigram", model, _Ids(), {"model_type": "qwen3", "vocab_size": model.args.vocab_size},
                         PrefixCache("bigram", 0))  # fmt: skip

    def drafting(loaded, target, drafter=None, settings=None):
        return Drafting("mtp", lambda t: MTPProposer(t, mtp), weights=mtp, kernel_module=mtp)

    engine = SpecEngine("bigram", loaded, name="mlx_mtp", drafting=drafting, max_context=4096,
                        kernels="off")  # fmt: skip
    engine.ahead = engine.compiled_rounds = True
    built_first = engine._batch_rounds_for(mtp).built_first
    # A build still running as the engine stops (failure injection: a sleep for the evaluation).
    slow = built_first._threads[("in flight",)] = threading.Thread(target=time.sleep, args=(1.5,))
    slow.start()

    async def main():
        await engine.start()
        await engine.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert not slow.is_alive()
