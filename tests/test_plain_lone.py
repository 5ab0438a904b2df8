"""A sequence alone decodes outside the batch (engines/mlx_plain/lone.py),
and moves back into it when another request arrives, without a changed token.

The plain engine runs on the session's tiny hybrid checkpoint (float32,
attention and recurrent layers, so both kinds of cache leave and rejoin the
batch). Each output is compared with mlx-lm's own `generate_step` (greedy,
or seeded sampling at each absolute position), and with the same engine
with the lone loop off, token for token.
"""

from __future__ import annotations

import asyncio

import pytest
from greedy import assert_same_greedy, greedy_reference, seeded_reference

from specgate.engines.base import (
    CacheSettings,
    GenerationRequest,
    Plan,
    PrefillProgress,
    SamplingParams,
    TokenEvent,
)
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_plain.engine import MLXPlainEngine

PLAN = Plan("mlx_plain", "none", 0, "concurrency")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_mlx_model(str(tiny_model), CacheSettings(disk_bytes=0))


def request(rid: str, prompt: list[int], n: int, sampling: SamplingParams = GREEDY,
            stop: frozenset[int] = frozenset()) -> GenerationRequest:  # fmt: skip
    return GenerationRequest(rid, "tiny", prompt, sampling, n, PLAN, stop, cache_scope=rid)


async def collect(engine, req, started: asyncio.Event | None = None, after: int = 0):
    tokens, events = [], []
    async for event in engine.generate(req):
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
            events.append(event)
            if started is not None and len(tokens) >= after:
                started.set()
    return tokens, events


def run(loaded, body, lone: bool = True, **settings):
    async def main():
        settings.setdefault("prefix_cache_size", 0)
        engine = MLXPlainEngine("tiny", loaded, max_context=2048, lone=lone, **settings)
        await engine.start()
        try:
            return await body(engine), engine.lone_tokens
        finally:
            await engine.stop()

    return asyncio.run(asyncio.wait_for(main(), 120))


PROMPT_A = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12]
PROMPT_B = [8, 1, 2, 3, 4, 5, 6, 200, 201, 202, 203, 11]


def test_a_lone_request_decodes_outside_the_batch_as_generate_step(loaded):
    (tokens, _), lone = run(loaded, lambda e: collect(e, request("a", PROMPT_A, 60)))
    want, margins = greedy_reference(loaded.model, PROMPT_A, 60)
    assert_same_greedy(tokens, want, margins)
    assert lone >= 50, f"only {lone} of 60 tokens on the lone loop"
    (batched, _), lone_off = run(loaded, lambda e: collect(e, request("a", PROMPT_A, 60)),
                                 lone=False)  # fmt: skip
    assert lone_off == 0 and batched == tokens


def test_a_request_that_finds_the_engine_idle_is_prefilled_outside_the_batch(loaded):
    """Its prompt goes through mlx-lm's own cache, as generate_step's does
    (the batch's padded cache and mask cost a lone GPU prefill ~20 %), and
    the prefix cache still gets its snapshot and its whole turn."""
    prompt = [(7 * i + 3) % 400 for i in range(90)]

    async def body(engine):
        first = await collect(engine, request("p", prompt, 30))
        fed_by_batch = engine._batch._counters.prompt_tokens  # mlx-lm internals, pinned
        again = await collect(engine, request("p", prompt, 30))  # an identical retry
        return first, again, fed_by_batch

    ((tokens, _), (retried, events), fed_by_batch), lone = run(
        loaded, body, prefix_cache_size=4, prefill_step_size=32)  # fmt: skip
    want, margins = greedy_reference(loaded.model, prompt, 30)
    assert_same_greedy(tokens, want, margins)
    assert fed_by_batch == 0 and lone == 60
    # The snapshot kept before the prompt's last token serves the retry.
    assert retried == tokens and events[-1].cached_tokens == len(prompt) - 1


def test_a_request_arriving_mid_prefill_takes_the_rest_of_the_prompt_into_the_batch(loaded):
    """A second request between two prefill chunks of a lone one: the first's
    prompt goes on in the batch from where it stands, with both exact."""
    long = [(11 * i + 5) % 450 for i in range(300)]

    async def body(engine):
        it = aiter(engine.generate(request("long", long, 25)))
        progress = []
        while not progress or progress[-1].processed == 0:  # its prompt is being fed, chunk by chunk
            if isinstance(event := await anext(it), PrefillProgress):  # (the first: its lookup)
                progress.append(event)
        # Holding the model's lock parks the worker before its next chunk,
        # so the second request is queued while chunks of the first remain.
        engine.loaded.lock.acquire()
        try:
            second = asyncio.create_task(collect(engine, request("b", PROMPT_B, 20)))
            while engine._inbox.empty():
                await asyncio.sleep(0.001)
        finally:
            engine.loaded.lock.release()
        tokens = []
        async for event in it:
            if isinstance(event, TokenEvent):
                tokens += event.token_ids
            elif isinstance(event, PrefillProgress):
                progress.append(event)
        return tokens, (await second)[0], progress, engine._batch._counters.prompt_tokens

    (a, b, progress, fed_by_batch), _ = run(loaded, body, prefill_step_size=16)
    for got, prompt, n in ((a, long, 25), (b, PROMPT_B, 20)):
        want, margins = greedy_reference(loaded.model, prompt, n)
        assert_same_greedy(got, want, margins)
    # The batch fed B's prompt (but its last token) and part, not all, of the long one's.
    assert len(PROMPT_B) - 1 < fed_by_batch < len(PROMPT_B) - 1 + len(long) - 1, fed_by_batch
    # Its progress goes on from where the lone chunks left it, in the batch.
    done = [p.processed for p in progress]
    assert done == sorted(set(done)) and done[-1] < len(long), done


def test_a_second_request_joins_and_leaves_without_a_changed_token(loaded):
    async def body(engine):
        started = asyncio.Event()
        first = asyncio.create_task(collect(engine, request("a", PROMPT_A, 120), started, 20))
        await started.wait()
        second = await collect(engine, request("b", PROMPT_B, 30))
        alone_before = engine.lone_tokens
        return await first, second, alone_before

    ((a, _), (b, _), before), lone = run(loaded, body)
    for got, prompt, n in ((a, PROMPT_A, 120), (b, PROMPT_B, 30)):
        want, margins = greedy_reference(loaded.model, prompt, n)
        assert_same_greedy(got, want, margins)
    # A decoded alone, then in the batch with B, then alone again.
    assert 20 <= before < 120 - 30, before
    assert lone > before, (before, lone)


def test_a_seeded_request_draws_the_same_tokens_alone_and_after_a_join(loaded):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    async def body(engine):
        started = asyncio.Event()
        first = asyncio.create_task(collect(engine, request("s", PROMPT_A, 80, params), started, 10))
        await started.wait()
        await collect(engine, request("g", PROMPT_B, 20))
        return await first

    (tokens, _), lone = run(loaded, body)
    want, margins = seeded_reference(loaded.model, PROMPT_A, 80, params)
    assert_same_greedy(tokens, want, margins)
    assert lone > 0


def test_a_stop_token_and_logprobs_on_the_lone_loop(loaded):
    want, _ = greedy_reference(loaded.model, PROMPT_A, 40)
    stop = want[25]
    cut = want[: want.index(stop)]
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    (tokens, events), lone = run(loaded, lambda e: collect(
        e, request("l", PROMPT_A, 40, params, frozenset({stop}))))  # fmt: skip
    assert tokens == cut and events[-1].finish_reason == "stop"
    assert lone > 0
    (_, batched), _ = run(loaded, lambda e: collect(
        e, request("l", PROMPT_A, 40, params, frozenset({stop}))), lone=False)  # fmt: skip
    got = [lp for e in events for lp in e.logprobs or []]
    ref = [lp for e in batched for lp in e.logprobs or []]
    assert [g.token_id for g in got] == [r.token_id for r in ref] == cut
    for g, r in zip(got, ref, strict=True):
        assert abs(g.logprob - r.logprob) < 1e-4 and len(g.top) == 2


def test_a_client_leaving_the_lone_loop_stops_it_and_the_next_request_is_served(loaded):
    async def body(engine):
        got = 0
        async for event in engine.generate(request("gone", PROMPT_A, 1000)):
            got += len(event.token_ids) if isinstance(event, TokenEvent) else 0
            if got >= 15:
                break  # the client hangs up
        for _ in range(200):  # the worker notices between two tokens
            if engine._in_flight == 0 and not engine._slots:
                break
            await asyncio.sleep(0.01)
        assert not engine._slots and engine._running == 0
        return await collect(engine, request("next", PROMPT_B, 20))

    (tokens, _), lone = run(loaded, body)
    want, margins = greedy_reference(loaded.model, PROMPT_B, 20)
    assert_same_greedy(tokens, want, margins)
    assert lone < 1000

