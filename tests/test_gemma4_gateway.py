"""A Gemma-4 model with its assistant drafter behind the gateway, through the real SDKs."""

from __future__ import annotations

import random
import re
import threading
import time

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.utils import load_model

from specgate.builders.drafters import build_gemma4_assistant
from specgate.builders.gemma4 import build_gemma4
from tests.conftest import start_gateway, stop_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    root = tmp_path_factory.mktemp("gw-gemma4")
    target = build_gemma4(root / "gemma4", sliding_window=16)
    drafter = build_gemma4_assistant(root / "assistant", target=target, tokenizer=False)
    g = start_gateway({"models": [
        {"id": "gemma", "path": str(target), "engines": ["mlx_plain", "mlx_assistant"],
         "drafter": str(drafter), "max_context": 2048},
        # For the hand-off test: its own policy, no exploration (as in test_plan_switch).
        {"id": "gemma-switch", "path": str(target), "engines": ["mlx_plain", "mlx_assistant"],
         "drafter": str(drafter), "max_context": 2048, "policy": {"explore_every": 0}},
    ]}, root)  # fmt: skip
    g.target = target
    yield g
    stop_gateway(g)


MESSAGES = [{"role": "user", "content": "Write a function that sorts a list of words by length, "
                                        "then alphabetically, and explain it."}]  # fmt: skip


def test_assistant_drafting_is_exact_and_measured(gw):
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    texts = {}
    for method in ("gemma4_assistant", "none"):
        raw = client.chat.completions.with_raw_response.create(
            model="gemma", messages=MESSAGES, max_tokens=48, temperature=0,
            extra_headers={"X-Specgate-Method": method})  # fmt: skip
        texts[method] = raw.parse().choices[0].message.content
        assert raw.headers["x-specgate-plan"].startswith(f"method={method};")
    assert texts["gemma4_assistant"] == texts["none"] and texts["none"]
    stream = client.chat.completions.create(
        model="gemma", messages=MESSAGES, max_tokens=48, temperature=0, stream=True,
        extra_headers={"X-Specgate-Method": "gemma4_assistant"})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == texts["none"]
    msg = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0).messages.create(
        model="gemma", max_tokens=48, messages=MESSAGES, extra_body={"temperature": 0},
        extra_headers={"X-Specgate-Method": "gemma4_assistant"})  # fmt: skip
    assert msg.content[0].text == texts["none"]
    sampled = client.chat.completions.create(
        model="gemma", messages=MESSAGES, max_tokens=16, temperature=0.8, seed=3,
        extra_headers={"X-Specgate-Method": "gemma4_assistant"})  # fmt: skip
    assert sampled.usage.completion_tokens > 0
    metrics = httpx.get(gw.base_url + "/metrics").text
    assert ('specgate_spec_decode_num_drafts_total{method="gemma4_assistant",model="gemma"}'
            in metrics)  # fmt: skip


def test_a_drafter_for_another_size_is_refused_naming_the_mismatch(gw, tmp_path):
    # Released for a target of hidden size 96, paired with one of 128.
    other = build_gemma4(tmp_path / "gemma4-other", hidden_size=96, tokenizer=False)
    wrong = build_gemma4_assistant(tmp_path / "assistant-other", target=other, tokenizer=False)
    with pytest.raises(
        RuntimeError,
        match="gemma-wrong failed to load: .*hidden size 96 "
        r"\(backbone_hidden_size\), this target's is 128",
    ):
        start_gateway({"models": [
            {"id": "gemma-wrong", "path": str(gw.target), "engines": ["mlx_plain", "mlx_assistant"],
             "drafter": str(wrong)}]}, tmp_path.resolve())  # fmt: skip


def test_a_losing_assistant_goes_plain_by_itself(gw):
    """A random assistant is (almost) never accepted, so once its rounds and
    plain steps are measured the policy plans plain decoding on its own;
    only exploration tries the assistant again."""
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    for method in ("gemma4_assistant", "none"):  # both measured, whatever ran before
        client.chat.completions.create(
            model="gemma",
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            extra_headers={"X-Specgate-Method": method},
        )
    plans = []
    for _ in range(8):
        raw = client.chat.completions.with_raw_response.create(
            model="gemma", messages=MESSAGES, max_tokens=24, temperature=0)  # fmt: skip
        plans.append(raw.headers["x-specgate-plan"])
    assert "method=none;depth=0;reason=measured_loss;source=live" in plans, plans
    assert not [p for p in plans if p.startswith("method=gemma4_assistant") and "source=live" in p]


def stream_plans(gw, tokens: int) -> list[str]:
    """The plans of gemma-switch's requests that decoded `tokens` tokens, from
    their access lines (written as a response's last byte goes out: waited for)."""
    for _ in range(100):
        lines = [
            line
            for line in gw.log().splitlines()
            if "model=gemma-switch" in line and f"completion_tokens={tokens} " in line
        ]
        if lines:
            return [re.search(r" plan=(\S+)", line).group(1) for line in lines]
        time.sleep(0.1)
    return []


def test_a_stream_moves_to_batching_and_back_across_wrapped_windows(gw):
    """The hand-off of test_plan_switch on Gemma-4: the stream starts with the
    assistant, goes to the batching engine (mlx-lm's batched rotating caches)
    when a second request comes, and comes back alone; the prompt and the
    output are longer than the sliding window, so the caches handed over
    have wrapped. The text equals plain greedy decoding's.

    The dance is read from the stream's access line, not from when the
    client saw tokens: a client slowed by a loaded machine may read the
    stream's tokens long after they were decoded (ci on 767d869)."""
    model, _ = load_model(gw.target)
    model.set_dtype(mx.float32)
    prompt = [random.Random(7).randrange(2000) for _ in range(40)]
    n = 160
    want, margins = greedy_reference(model, prompt, n)
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)

    def second_request():
        client.completions.create(
            model="gemma-switch",
            prompt=[5, 6, 7],
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    stream = client.completions.create(
        model="gemma-switch",
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    b = threading.Thread(target=second_request)
    got = []
    for chunk in stream:
        got += chunk.choices[0].token_ids or [] if chunk.choices else []
        if got and not b.ident:  # decoding with the assistant, ~n tokens to go
            b.start()
    b.join(timeout=60)
    assert not b.is_alive()
    assert_same_greedy(got, want, margins)
    # The stream's own plans, in order: alone, batched beside the second
    # request, alone again (then, alone, whatever the policy's live costs
    # say of this random assistant: ci33 saw it go plain and back again).
    (plans,) = stream_plans(gw, n)
    assert plans.startswith("gemma4_assistant>none>gemma4_assistant"), plans
