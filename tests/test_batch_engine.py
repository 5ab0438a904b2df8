"""The speculative engine decodes concurrent requests in one batch (issue 45).

A SpecEngine (n-gram drafting) on a tiny float32 qwen3 (tests/test_batch_kv.py's),
driven through its async generate() as the gateway drives it, each request
held to speculation by a FixedPlanner (as a forced method is): requests
that arrive while one decodes join it in mlx_spec/batch_decoder.py's
batch, one prefill chunk per round. Every stream equals its plain greedy
decoding (seeded: its own solo run, token for token) whatever its depth,
penalty or length, and whoever joins, leaves or is cancelled mid-way; the
rounds really were batched (RoundStats.batch); a stream planned onto
another engine mid-batch leaves with a Handoff that holds its tokens so
far. A request that fails to join is told and the batch goes on; a
batched round that fails tells every request in it, and the engine goes on
serving (failure injections).
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from greedy import assert_same_greedy, greedy_reference
from test_batch_decoder import hybrid  # noqa: F401  (the tiny hybrid fixture)
from test_batch_kv import tiny_qwen3

from specgate.engines.base import (
    GenerationRequest,
    Handoff,
    LiveState,
    Plan,
    RoundStats,
    SamplingParams,
    TokenEvent,
)
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.drafting.ngram import proposer as ngram
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.engine import SpecEngine
from specgate.engines.settings import NgramSettings
from specgate.policies.decide import FixedPlanner

VOCAB = 128
N_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0)


class _Ids:
    """Token ids only: the tiny model has no text."""

    class _Detok:
        last_segment = ""

        def add_token(self, token):
            pass

        def finalize(self):
            pass

    eos_token_ids: set = set()

    @property
    def detokenizer(self):
        return self._Detok()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(VOCAB, 5)


def engine_for(model) -> SpecEngine:
    loaded = LoadedModel("tiny", model, _Ids(), {"model_type": "qwen3", "vocab_size": VOCAB},
                         PrefixCache("tiny", 0))  # fmt: skip
    return SpecEngine("tiny", loaded, name="mlx_ngram", drafting=ngram.drafting, max_context=4096,
                      kernels="off", prefill_step_size=16)  # fmt: skip


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(9)
    out = []
    for i in range(n):
        seg = [rng.randrange(VOCAB) for _ in range(5 + 7 * i)]
        out.append(seg + seg[: len(seg) // 2])  # something to copy
    return out


def request(i: int, prompt: list[int], params=GREEDY, depth: int = 3, n: int = N_TOKENS):
    plan = Plan("mlx_ngram", "ngram", depth, "forced_by_request")
    return GenerationRequest(f"r{i}", "tiny", prompt, params, n, plan), FixedPlanner(plan)


async def collect(engine, req, planner, stop_after: int | None = None):
    """The request's tokens, its round stats, and a Handoff if it got one;
    `stop_after` tokens: the client goes away then."""
    tokens, stats, handoff = [], [], None
    async for ev in engine.generate(req, planner):
        if isinstance(ev, RoundStats):
            stats.append(ev)
        elif isinstance(ev, TokenEvent):
            tokens += ev.token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                break
        elif isinstance(ev, Handoff):
            handoff = ev
    return tokens, stats, handoff


def serving(model, work):
    """await work(engine) on a started engine over `model`, then stop it."""

    async def main():
        engine = engine_for(model)
        await engine.start()
        try:
            return await work(engine)
        finally:
            await engine.stop()

    return asyncio.run(asyncio.wait_for(main(), 300))


def run(model, jobs):
    """jobs: [(request, planner, stop_after)], all in flight at once."""
    return serving(model, lambda engine: asyncio.gather(*(collect(engine, r, p, s) for r, p, s in jobs)))


def test_concurrent_requests_decode_in_one_batch_each_as_alone(model):
    ps = prompts(6)
    seeded = SamplingParams(temperature=0.8, seed=3)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    # (prompt, sampling, depth, max tokens, client leaves after)
    spec = [(0, GREEDY, 4, N_TOKENS, None), (1, GREEDY, 2, 20, None), (2, GREEDY, 0, N_TOKENS, None),
            (3, seeded, 3, N_TOKENS, None), (4, penalised, 3, N_TOKENS, None),
            (5, GREEDY, 3, N_TOKENS, 9)]  # fmt: skip
    jobs = [(*request(i, ps[p], params, depth, n), stop) for i, (p, params, depth, n, stop) in enumerate(spec)]
    got = run(model, jobs)
    # Each seeded or penalised one alone, through the same engine: the reference.
    alone = {i: run(model, [jobs[i]])[0][0] for i in (3, 4)}
    batches = [s.batch for _, stats, _ in got for s in stats]
    assert max(batches) >= 4, batches  # they decoded together
    for i, (tokens, _stats, handoff) in enumerate(got):
        p, params, depth, n, stop = spec[i]
        assert handoff is None
        if i in alone:
            assert tokens == alone[i], i
        elif stop is not None:
            assert stop <= len(tokens) < n  # it went away; the others went on
            want, margins = greedy_reference(model, ps[p], len(tokens))
            assert_same_greedy(tokens, want, margins)
        else:
            assert len(tokens) == n
            want, margins = greedy_reference(model, ps[p], n)
            assert_same_greedy(tokens, want, margins)
    # Drafts stood inside the batch (the greedy text repeats, so copies match).
    assert sum(s.accepted for _, stats, _ in got[:2] for s in stats if s.batch > 1) > 0


class _MovesAfter:
    """Speculation for `rounds` rounds, then the plain engine's plan."""

    def __init__(self, rounds: int):
        self.left = rounds

    def plan(self, state: LiveState) -> Plan:
        self.left -= 1
        if self.left >= 0:
            return Plan("mlx_ngram", "ngram", 3, "spec_on")
        return Plan("mlx_plain", "none", 0, "concurrency")


def test_a_stream_planned_elsewhere_leaves_the_batch_with_its_tokens(model):
    ps = prompts(3)
    stay = [(*request(i, ps[i]), None) for i in (0, 1)]
    req, _ = request(2, ps[2])
    got = run(model, [*stay, (req, _MovesAfter(4), None)])
    tokens, stats, handoff = got[2]
    assert handoff is not None and handoff.plan.engine == "mlx_plain"
    assert handoff.tokens == ps[2] + tokens  # prompt and every token it was sent
    assert any(s.batch > 1 for s in stats)
    want, margins = greedy_reference(model, ps[2], len(tokens))
    assert_same_greedy(tokens, want, margins)
    # Its caches hold the sequence but its last token, ready for the plain engine.
    assert all(c.offset == len(handoff.tokens) - 1 for c in handoff.cache)
    for i in (0, 1):
        want, margins = greedy_reference(model, ps[i], N_TOKENS)
        assert_same_greedy(got[i][0], want, margins)


def test_rounds_are_counted_by_the_batch_they_ran_in():
    from types import SimpleNamespace

    from specgate.gateway.serving.metrics import Metrics

    # A model registry with nothing loaded (the scrape-time gauges read it).
    m = Metrics(SimpleNamespace(models={}, memory_budget=0, models_budget=0, prefix_cache_budget=0))
    m.round(RoundStats("tiny", "ngram", 3, [True, True, False], verify_width=4, batch=3))
    m.round(RoundStats("tiny", "ngram", 2, [True, False], verify_width=3, batch=3))
    m.round(RoundStats("tiny", "ngram", 1, [False], verify_width=2))
    m.round(RoundStats("tiny", "none", 0, batch=4))  # a plain batch step: not speculation's

    def value(name: str, batch: str) -> float | None:
        return m.registry.get_sample_value(f"specgate_spec_decode_batch_{name}_total",
                                           {"model": "tiny", "method": "ngram", "batch": batch})  # fmt: skip

    assert (value("rounds", "3"), value("draft_tokens", "3"), value("accepted_tokens", "3"),
            value("verify_rows", "3")) == (2, 5, 3, 7)  # fmt: skip
    assert (value("rounds", "1"), value("accepted_tokens", "1")) == (1, 0)
    assert m.registry.get_sample_value("specgate_spec_decode_batch_rounds_total",
                                       {"model": "tiny", "method": "none", "batch": "4"}) is None  # fmt: skip


async def outcome(engine, req, planner):
    """The request's tokens, or the error that ended it."""
    from specgate.engines.base import EngineError

    try:
        return (await collect(engine, req, planner))[0]
    except EngineError as e:
        return e


def test_a_request_failing_to_join_is_told_and_the_batch_goes_on(model, monkeypatch):
    # Failure injection (a fake): one request's decoder cannot be made.
    real = SpecEngine.make_decoder

    def make_decoder(self, request, cache, cached):
        if request.request_id == "r2":
            raise RuntimeError("injected: r2 cannot decode")
        return real(self, request, cache, cached)

    monkeypatch.setattr(SpecEngine, "make_decoder", make_decoder)
    ps = prompts(4)

    got = serving(model, lambda engine: asyncio.gather(*(outcome(engine, *request(i, ps[i]))
                                                         for i in range(4))))  # fmt: skip
    assert "injected: r2 cannot decode" in str(got[2])
    for i in (0, 1, 3):
        want, margins = greedy_reference(model, ps[i], N_TOKENS)
        assert_same_greedy(got[i], want, margins)


def test_a_batch_round_that_fails_tells_every_request_in_it(model, monkeypatch):
    # Failure injection (a fake): the third batched round raises.
    from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder

    real, calls = BatchSpecDecoder.round, []

    def round_(self, depths):
        calls.append(len(depths))
        if len(calls) == 3:
            raise RuntimeError("injected: the verify forward failed")
        return real(self, depths)

    monkeypatch.setattr(BatchSpecDecoder, "round", round_)
    ps = prompts(3)

    async def work(engine):
        got = await asyncio.gather(*(outcome(engine, *request(i, ps[i])) for i in range(3)))
        # ... and the engine serves the next request.
        return got, await outcome(engine, *request(9, ps[0]))

    got, after = serving(model, work)
    failed = [g for g in got if not isinstance(g, list)]
    assert failed and all("injected: the verify forward failed" in str(g) for g in failed), got
    assert len(failed) == calls[2]  # every request in that round was told
    want, margins = greedy_reference(model, ps[0], N_TOKENS)
    assert_same_greedy(after, want, margins)


class _HoldsBatchWidths:
    """Failure injection: a correct kernel (the stock op) whose proofs of
    widths only a batch verifies (more rows than `lone`) wait for
    `release`, as a slow proof on a GPU would; every call's (rows, thread)
    is noted."""

    def __init__(self, lone: int):
        self.lone, self.release = lone, threading.Event()
        self.calls: list[tuple[int, str]] = []

    def __call__(self, x, wq, s, b, gs, bits):
        from specgate.kernels import qmm

        rows = x.size // x.shape[-1]
        self.calls.append((rows, threading.current_thread().name))
        if rows > self.lone and threading.current_thread().name.startswith("kernel-proofs"):
            assert self.release.wait(120), "the test never released the proofs"
        return qmm.reference_qmm(x, wq, s, b, gs, bits)


def test_batch_widths_are_proved_after_the_switch_and_never_inside_a_round(tmp_path):
    """A quantized trunk with the verify kernels (a correct one): its lone
    widths (2..depth+1) are proved and switched on first, then the widths
    only a batch verifies (up to 16 rows) in the background. Meanwhile a
    batch wider than the proved rows verifies stock: no round proves a
    shape (on a GPU that stalled every stream in it for seconds). Once
    proved, batched rounds verify through the kernels. Every stream equals
    its plain greedy decoding throughout."""
    import mlx.core as mx
    import mlx.nn as nn

    from specgate.kernels import qmm
    from specgate.kernels.guard import Candidate, Guard

    model = tiny_qwen3(VOCAB, 5)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())  # as a load leaves them (the proofs run on their own thread)
    depth = 3
    kernel = _HoldsBatchWidths(lone=depth + 1)
    guard = Guard([Candidate("held", "1", kernel)], cache_dir=tmp_path, machine="test-machine",
                  reps=1, inner=1, margin=float("inf"))  # fmt: skip
    loaded = LoadedModel("tiny", model, _Ids(), {"model_type": "qwen3", "vocab_size": VOCAB},
                         PrefixCache("tiny", 0))  # fmt: skip
    engine = SpecEngine("tiny", loaded, name="mlx_ngram", drafting=ngram.drafting, max_context=4096,
                        kernel_guard=guard, prefill_step_size=16,
                        settings=NgramSettings(depth=depth))  # fmt: skip
    switch = engine.kernel_switch
    assert engine.kernels_ready(120) and engine.target.kernels
    assert switch.rows == depth + 1 and not switch.batch_done.is_set()
    ps = prompts(3)

    def rounds_through_kernels(got) -> set[int]:
        worker = {rows for rows, thread in kernel.calls if not thread.startswith("kernel-proofs")}
        for i, (tokens, _stats, _) in enumerate(got):
            want, margins = greedy_reference(model, ps[i], N_TOKENS)
            assert_same_greedy(tokens, want, margins)
        assert max(s.batch for _, stats, _ in got for s in stats) >= 2
        return worker

    async def main():
        await engine.start()
        try:
            jobs = [request(i, p, depth=depth) for i, p in enumerate(ps)]
            got = await asyncio.gather(*(collect(engine, r, p) for r, p in jobs))
            during = rounds_through_kernels(got)
            kernel.release.set()
            assert await asyncio.to_thread(switch.batch_done.wait, 120)
            kernel.calls.clear()
            jobs = [request(i + 3, p, depth=depth) for i, p in enumerate(ps)]
            got = await asyncio.gather(*(collect(engine, r, p) for r, p in jobs))
            return during, rounds_through_kernels(got)
        finally:
            kernel.release.set()
            await engine.stop()

    during, after = asyncio.run(asyncio.wait_for(main(), 300))
    assert during and max(during) <= depth + 1, during  # lone rounds only: batches went stock
    assert switch.rows == qmm.MAX_M
    assert max(after) > depth + 1, after  # batched rounds, through the kernels now

    # A later process on this machine: every verdict recorded, the kernels
    # wired at load for every width at once; its background thread only
    # warms each lone width and batch shape (no proof), so no first round
    # builds a shape's kernels.
    checks = guard.checks_run
    kernel.calls.clear()
    again = SpecEngine("tiny", loaded, name="mlx_ngram", drafting=ngram.drafting, max_context=4096,
                       kernel_guard=guard, settings=NgramSettings(depth=depth))  # fmt: skip
    assert again.target.kernels and again.kernel_switch.rows == qmm.MAX_M
    assert again.kernel_switch.batch_done.wait(120)
    warmed = {rows for rows, thread in kernel.calls if thread.startswith("kernel-proofs")}
    assert warmed >= {2, 3, 4, *again.kernel_switch.batch_widths}, warmed
    assert guard.checks_run == checks


def test_a_hybrid_s_requests_decode_in_one_batch_each_as_alone(hybrid):  # noqa: F811
    """A Qwen3.5 hybrid (tests/test_batch_decoder.py's): its recurrent
    layers are batched too, so concurrent requests join one batch rather
    than queue, and each equals its plain greedy decoding."""
    ps = prompts(4)
    jobs = [(*request(i, ps[i], depth=depth), None) for i, depth in enumerate((3, 2, 0, 4))]
    got = run(hybrid, jobs)
    assert max(s.batch for _, stats, _ in got for s in stats) >= 3, "they queued"
    for i, (tokens, _stats, handoff) in enumerate(got):
        assert handoff is None and len(tokens) == N_TOKENS
        want, margins = greedy_reference(hybrid, ps[i], N_TOKENS)
        assert_same_greedy(tokens, want, margins)
