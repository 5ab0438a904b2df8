"""A live stream moves between speculation and batching, and its output does not change.

A greedy stream starts on the MTP engine (alone on its model: `spec_on`).
A second request arrives: the first stream's planner sees it at the next
round and hands the sequence to the batching engine (`concurrency`), which
decodes both together. The second ends: alone again, the sequence goes back
to the MTP engine (`spec_on`). Float32 tiny checkpoint, so the output must
equal mlx-lm's plain greedy decoding token for token (near-ties as
everywhere). The switches are counted in specgate_plan_decisions_total.
"""

from __future__ import annotations

import json
import random
import re
import threading

import httpx
import mlx.core as mx
import openai
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.utils import load_model

from tests.conftest import start_gateway, stop_gateway

N = 240


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    g = start_gateway({"models": [
        {"id": "switch", "path": str(tiny_model), "engines": ["mlx_plain", "mlx_mtp"],
         "mtp_depth": 2, "max_context": 2048,
         # No exploration: the stream starts speculating (nothing measured:
         # speculate when idle) and comes back to it alone, before a plain
         # step alone is measured; with it, the first request explores plain.
         "policy": {"explore_every": 0}},
    ]}, tmp_path_factory.mktemp("gw-switch"))
    yield g
    stop_gateway(g)


def decisions(gw) -> dict[str, float]:
    text = httpx.get(gw.base_url + "/metrics").text
    out = {}
    for m in re.finditer(r'^specgate_plan_decisions_total\{(.*?)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels["model"] == "switch":
            out[f'{labels["method"]}/{labels["reason"]}'] = float(m.group(2))
    return out


def test_a_stream_under_a_grammar_switches_with_the_same_output(gw):
    """The same dance held to a JSON schema: each engine rebuilds the grammar
    state from the tokens it is handed, so the text equals plain decoding's
    under the same grammar. (First in the module: its rounds are costed as
    constrained ones, apart from the next test's.)"""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 400,
                                                      "maxLength": 400}},
              "required": ["s"], "additionalProperties": False}  # fmt: skip
    kw = dict(model="switch", messages=[{"role": "user", "content": "Say something long."}],
              temperature=0, max_tokens=1000,
              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    before = decisions(gw)
    pieces, b_done, count = [], threading.Event(), 0

    def second_request():
        client.completions.create(model="switch", prompt=[5, 6, 7], max_tokens=40,
                                  temperature=0, extra_body={"ignore_eos": True})
        b_done.set()

    b = threading.Thread(target=second_request)
    during_b = after_b = 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        text = chunk.choices[0].delta.content or "" if chunk.choices else ""
        pieces.append(text)
        count += 1
        if count >= 20 and not b.is_alive() and not b_done.is_set():
            b.start()
        elif b.is_alive():
            during_b += len(text)
        elif b_done.is_set():
            after_b += len(text)
    b.join(timeout=60)
    assert b_done.is_set() and during_b > 0 and after_b > 0, (during_b, after_b)
    grew = {k: v - before.get(k, 0) for k, v in decisions(gw).items()}
    # Plain decoding alone, asked after (its steps would be measured costs,
    # and the stream might then stay plain when alone again).
    want = client.chat.completions.create(**kw, extra_headers={"X-Specgate-Method": "none"})
    assert "".join(pieces) == want.choices[0].message.content
    assert len(json.loads(want.choices[0].message.content)["s"]) == 400
    assert grew.get("mtp/spec_on", 0) >= 2 and grew.get("none/concurrency", 0) >= 2, grew


def test_stream_switches_to_batching_and_back_with_the_same_output(gw, tiny_model):
    model, _ = load_model(tiny_model)
    model.set_dtype(mx.float32)
    prompt = [random.Random(7).randrange(2000) for _ in range(24)]
    want, margins = greedy_reference(model, prompt, N)
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    before = decisions(gw)

    got, b_done = [], threading.Event()

    def second_request():
        client.completions.create(model="switch", prompt=[5, 6, 7], max_tokens=40,
                                  temperature=0, extra_body={"ignore_eos": True})
        b_done.set()

    stream = client.completions.create(model="switch", prompt=prompt, max_tokens=N,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    b = threading.Thread(target=second_request)
    during_b = after_b = 0
    for chunk in stream:
        ids = chunk.choices[0].token_ids or [] if chunk.choices else []
        got += ids
        if len(got) >= 20 and not b.is_alive() and not b_done.is_set():
            b.start()
        elif b.is_alive():
            during_b += len(ids)
        elif b_done.is_set():
            after_b += len(ids)
    b.join(timeout=60)
    assert b_done.is_set()
    assert during_b > 0 and after_b > 0, (during_b, after_b)  # both phases really happened
    ties = assert_same_greedy(got, want, margins)

    grew = {k: v - before.get(k, 0) for k, v in decisions(gw).items()}
    print(f"\nplan decisions during the test: {grew}; near-tie divergences: {ties}")
    assert grew.get("mtp/spec_on", 0) >= 2  # the start, and the way back
    assert grew.get("none/concurrency", 0) >= 2  # the second request, and the switch to batching

