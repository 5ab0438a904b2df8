"""A live stream moves between speculation and batching, and its output does not change.

A greedy stream starts on the MTP engine (alone on its model: `spec_on`).
A second request arrives: the first stream's planner sees it at the next
round and hands the sequence to the batching engine (`concurrency`), which
decodes both together. The second ends: alone again, the sequence goes back
to the MTP engine (`spec_on`). Float32 tiny checkpoint, so the output must
equal mlx-lm's plain greedy decoding token for token (near-ties as
everywhere). The switches are counted in specgate_plan_decisions_total.

The gateway runs in this process, its policy's estimates pinned where
speculation wins alone and batching wins with company (failure injection:
PinnedCosts, PinnedAcceptance). With live ones, whether the stream came back
depended on timing: plain steps timed alone (the second request decoding
alone before the stream's handoff reached it, or the stream alone before the
second request's end was noticed) taught the policy that this checkpoint's
random head loses, and the stream then stayed plain.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from types import SimpleNamespace

import httpx
import mlx.core as mx
import openai
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.utils import load_model

from specgate.engines.base import (
    GenerationRequest,
    LiveState,
    Plan,
    PrefillProgress,
    SamplingParams,
)
from specgate.policies.acceptance import AcceptanceTracker
from specgate.policies.decide import FixedPlanner
from specgate.policies.live_costs import LiveCosts, RunningEstimate
from tests.conftest import in_process_gateway

N = 240


class PinnedCosts(LiveCosts):
    """Failure injection: round costs as if this machine had measured a
    plain step at 10 ms at any batch size (batching two is then worth 2x)
    and an MTP round at 10 + 6 ms per draft, whatever it really measures (a
    CPU running a model this small cannot show speculation winning).
    Rounds inside a batch are not pinned (LiveCosts._batched)."""

    per_draft = 0.006  # seconds a draft adds to a round

    def get(self, method, width, bucket):
        seconds = 0.010 if method == "none" else 0.010 + self.per_draft * width
        return RunningEstimate(mean=seconds, count=self.min_samples, warm_up=0)

    def measured(self, method, bucket=None):
        return {(w, 0): self.get(method, w, 0) for w in range(1, 9)}


class PinnedAcceptance(AcceptanceTracker):
    """Failure injection: every draft accepted, as the policy sees it (the
    random head's drafts are really rejected, so every switch also hands
    over a sequence whose drafts were just cut back)."""

    def rates(self, model, content):
        return {"mtp": [1.0] * 8}


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    """With these estimates a plan at depth d decodes (d+1) / (10 + 6d) ms
    alone: 125..167 tokens/s against plain decoding's 100 (x1.1 its margin)
    alone, 200 with company; so a request speculates alone and batches with
    another, whatever the timing."""
    tmp = tmp_path_factory.mktemp("gw-switch")
    config = {"models": [
        {"id": "switch", "path": str(tiny_model), "engines": ["mlx_plain", "mlx_mtp"],
         "mtp_depth": 2, "max_context": 2048,
         # No request bound: it times rounds by the wall clock, where this
         # random head's rejected drafts lose (tests/test_request_guard.py).
         "policy": {"explore_every": 0, "request_floor": 0}}]}  # fmt: skip
    with in_process_gateway(config, tmp / "home") as (app, base):
        served = app.state.registry.models["switch"]
        policy = served.policy
        policy.costs = policy.constrained_costs = PinnedCosts()
        policy.acceptance = PinnedAcceptance()
        trace = trace_plans(policy, app.state.metrics)
        yield SimpleNamespace(base_url=base, api=base + "/v1", served=served, trace=trace)


def trace_plans(policy, metrics) -> list[tuple]:
    """A failure's evidence (not a fake: the real calls, recorded): each
    plan counted, and each change in the model's state as a thread's
    planner saw it, with the thread (an engine's worker, or the event loop
    planning an arrival)."""
    trace, last = [], {}
    state, planned = policy.live_state, metrics.planned

    def traced_state():
        live, thread = state(), threading.current_thread().name
        if last.get(thread) != live:
            last[thread] = live
            trace.append((time.monotonic(), thread, "sees", live.active_requests,
                          live.waiting_requests))  # fmt: skip
        return live

    def traced_plan(model, plan):
        trace.append((time.monotonic(), threading.current_thread().name, plan.method, plan.reason))
        planned(model, plan)

    policy.live_state, metrics.planned = traced_state, traced_plan
    return trace


def decisions(gw) -> dict[str, float]:
    text = httpx.get(gw.base_url + "/metrics").text
    out = {}
    for m in re.finditer(r'^specgate_plan_decisions_total\{(.*?)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels["model"] == "switch":
            out[f'{labels["method"]}/{labels["reason"]}'] = float(m.group(2))
    return out


def switched(gw, before: dict[str, float]) -> dict[str, float]:
    """The decisions made since `before`, by method/reason."""
    return {k: v - before.get(k, 0) for k, v in decisions(gw).items() if v > before.get(k, 0)}


# The stream's start and its way back; the second request's start, and the
# stream's switch to batching: every plan of the dance, once.
DANCE = {"mtp/spec_on": 2, "none/concurrency": 2}


def test_a_stream_under_a_grammar_switches_with_the_same_output(gw):
    """The same dance held to a JSON schema: each engine rebuilds the grammar
    state from the tokens it is handed, so the text equals plain decoding's
    under the same grammar."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 400,
                                                      "maxLength": 400}},
              "required": ["s"], "additionalProperties": False}  # fmt: skip
    kw = dict(model="switch", messages=[{"role": "user", "content": "Say something long."}],
              temperature=0, max_tokens=1000,
              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    before, since = decisions(gw), len(gw.trace)
    b = threading.Thread(target=second_request, args=(client,))
    pieces = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if not b.ident:  # the stream is decoding, on the MTP engine, with ~400 tokens to go
            b.start()
    b.join(timeout=60)
    assert not b.is_alive()
    grew = switched(gw, before)
    want = client.chat.completions.create(**kw, extra_headers={"X-Specgate-Method": "none"})
    assert "".join(pieces) == want.choices[0].message.content
    assert len(json.loads(want.choices[0].message.content)["s"]) == 400
    assert grew == DANCE, (grew, gw.trace[since:])
    # Every response has ended (its lease given back just after): none is
    # left counted as answering, which would hide an arriving request.
    deadline = time.monotonic() + 10
    while gw.served.in_use and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (gw.served.in_use, gw.served.answering) == (0, 0)


def test_a_seeded_sampled_stream_switches_with_the_same_output(gw):
    """The same dance, sampled with a seed: each engine samples a token with
    the noise of its seed and position, so the stream's text is what plain
    batching alone gives the same request (the draws once came from a key
    stream the MTP engine also spent on its drafts, so the text changed)."""
    prompt = [random.Random(8).randrange(2000) for _ in range(24)]
    kw = dict(model="switch", prompt=prompt, max_tokens=N, temperature=0.8, top_p=0.95, seed=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    before, since = decisions(gw), len(gw.trace)
    b = threading.Thread(target=second_request, args=(client,))
    got = []
    for chunk in client.completions.create(**kw, stream=True):
        got += chunk.choices[0].token_ids or [] if chunk.choices else []
        if got and not b.ident:  # the stream is decoding, on the MTP engine, with ~N tokens to go
            b.start()
    b.join(timeout=60)
    assert not b.is_alive()
    grew = switched(gw, before)
    want = client.completions.create(**kw, extra_headers={"X-Specgate-Method": "none"})
    assert got == want.choices[0].token_ids and len(got) == N
    assert grew == DANCE, (grew, gw.trace[since:])


def second_request(client) -> None:
    """The second request: 40 tokens, batched with the stream."""
    client.completions.create(model="switch", prompt=[5, 6, 7], max_tokens=40, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip


def test_stream_switches_to_batching_and_back_with_the_same_output(gw, tiny_model):
    model, _ = load_model(tiny_model)
    model.set_dtype(mx.float32)
    prompt = [random.Random(7).randrange(2000) for _ in range(24)]
    want, margins = greedy_reference(model, prompt, N)
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    before, since = decisions(gw), len(gw.trace)
    stream = client.completions.create(model="switch", prompt=prompt, max_tokens=N,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    b = threading.Thread(target=second_request, args=(client,))
    got = []
    for chunk in stream:
        got += chunk.choices[0].token_ids or [] if chunk.choices else []
        if got and not b.ident:  # the stream is decoding, on the MTP engine, with ~N tokens to go
            b.start()
    b.join(timeout=60)
    assert not b.is_alive()
    ties = assert_same_greedy(got, want, margins)
    grew = switched(gw, before)
    print(f"\nplan decisions during the test: {grew}; near-tie divergences: {ties}")
    assert grew == DANCE, (grew, gw.trace[since:])


@pytest.mark.parametrize("engine", ["mlx_plain", "mlx_mtp"])
def test_a_request_decoded_to_its_end_is_not_counted_while_its_answer_is_sent(gw, engine):
    """The worker has decoded a request to its end; the event loop, which
    can lag behind a busy worker, has not taken its last events yet. The
    model's planning state counts it no more, so a stream it leaves alone is
    alone at its next round. (It was counted until then: the stream stayed
    on batching, alone, for as long as the lag lasted, and the dance above
    could end without its way back.)"""
    served = gw.served
    plan = Plan(engine, "none" if engine == "mlx_plain" else "mtp",
                0 if engine == "mlx_plain" else 2, "forced_by_request")  # fmt: skip
    greedy = SamplingParams(temperature=0)
    request = GenerationRequest(f"ended-{engine}", "switch", [5, 6, 7], greedy, 4, plan)

    async def decoded_not_taken() -> LiveState:
        events = served.engines[engine].generate(request, FixedPlanner(plan))
        try:
            # Submitted and decoding (its first token; before it, the prefix
            # cache's lookup: PrefillProgress); the rest is left unread.
            while isinstance(await anext(events), PrefillProgress):
                pass
            while served.engines[engine].live_state().active_requests:
                await asyncio.sleep(0.01)  # until the worker has decoded its last token
            return served.planning_state()
        finally:
            await events.aclose()

    assert asyncio.run(decoded_not_taken()) == LiveState(0, 0, 0)
