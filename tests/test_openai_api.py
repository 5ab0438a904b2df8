"""The OpenAI API end to end: real uvicorn, real `openai` SDK, mlx-lm as reference."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm import load

from specgate.gateway.serving.images import TOOL_RESULT_IMAGE

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import os\nimport sys\n",
    "class Parser:",
    "Once upon a time",
    "for i in range(10):",
    "# TODO: fix the",
    "SELECT * FROM users WHERE",
]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Plain mlx-lm greedy decoding of the same checkpoint, in this process."""
    model, tokenizer = load(str(tiny_model))
    eos = set(tokenizer.eos_token_ids)

    def chat_tokens(text: str) -> list[int]:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True))

    def greedy(prompt_tokens: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        return greedy_reference(model, prompt_tokens, max_tokens, eos)

    return type("Ref", (), {"chat_tokens": staticmethod(chat_tokens), "greedy": staticmethod(greedy),
                            "tokenizer": tokenizer})


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(gateway):
    return openai.AsyncOpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=120)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# -- serving ---------------------------------------------------------------------


def test_models_health_ready(gateway, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-narrow", "demo"]
    assert httpx.get(gateway.base_url + "/health").json() == {"status": "ok"}
    ready = httpx.get(gateway.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["models"]["tiny"] == "ready"


def test_chat_greedy_equals_mlx_lm(client, reference):
    want, margins = reference.greedy(reference.chat_tokens(PROMPTS[0]), 48)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=48,
        temperature=0, extra_body={"return_token_ids": True},
    )
    assert raw.headers["x-specgate-plan"] == "method=none;depth=0;reason=no_drafter;source=rule"
    resp = raw.parse()
    choice = resp.choices[0]
    assert_same_greedy(token_ids(choice), want, margins)
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.tokenizer.decode(token_ids(choice))
    assert choice.finish_reason == ("length" if len(want) == 48 else "stop")
    assert resp.usage.prompt_tokens == len(reference.chat_tokens(PROMPTS[0]))
    assert resp.usage.completion_tokens == len(token_ids(choice))


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                  max_tokens=32, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_greedy_stream_and_not(client, reference):
    prompt = PROMPTS[2]
    want, margins = reference.greedy(reference.tokenizer.encode(prompt), 40)
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert_same_greedy(token_ids(resp.choices[0]), want, margins)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == resp.choices[0].text
    # A prompt given as token ids is served the same.
    by_ids = client.completions.create(model="tiny", prompt=reference.tokenizer.encode(prompt),
                                       max_tokens=40, temperature=0)
    assert by_ids.choices[0].text == resp.choices[0].text


def test_eight_concurrent_streams_each_equal_sequential(aclient, reference, capsys):
    refs = [reference.greedy(reference.chat_tokens(p), 40) for p in PROMPTS]

    async def one(prompt):
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=40,
            temperature=0, stream=True, extra_body={"return_token_ids": True})
        ids = []
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    got = asyncio.run(all_at_once())
    ties = sum(assert_same_greedy(g, w, m) for g, (w, m) in zip(got, refs, strict=True))
    with capsys.disabled():  # reported in every run, not only with -s
        print(f"\n[8 concurrent streams vs sequential: {ties} divergence(s), "
              f"each at a checked near-tie]", end=" ")


def test_stop_strings(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[3], max_tokens=40, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    words = [w for w in re.findall(r"[A-Za-z]{3,}", text) if text.find(w) > 0]
    assert words, f"no stop candidate in {text!r}"
    stop = words[0]
    cut = client.completions.create(**kwargs, stop=[stop, "zzzz-never"]).choices[0]
    assert cut.text == text[: text.find(stop)]
    assert cut.finish_reason == "stop"
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_sampling_parameters_reach_the_engine(client):
    msgs = [{"role": "user", "content": PROMPTS[4]}]
    greedy = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24,
                                            temperature=0).choices[0].message.content
    # top_k=1 and min_p=1 keep only the argmax: sampling then equals greedy.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24,
                                             temperature=1.5, extra_body=extra)
        assert out.choices[0].message.content == greedy, extra
    seeded = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24,
                                             temperature=1.0, top_p=0.95, seed=s)
              .choices[0].message.content for s in (7, 7, 8)]
    assert seeded[0] == seeded[1] and seeded[0] != seeded[2]
    # Over 200 greedy tokens a random model repeats itself; frequency and
    # presence penalties must make it repeat less.
    def repeats(**extra) -> int:
        out = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=200, temperature=0, extra_body={
                "return_token_ids": True, "ignore_eos": True, **extra})
        ids = token_ids(out.choices[0])
        return len(ids) - len(set(ids))

    plain, penalised = repeats(), repeats(frequency_penalty=2.0, presence_penalty=2.0)
    assert plain > 0 and penalised < plain, (plain, penalised)
    assert repeats(repetition_penalty=10.0) < plain


def test_logprobs(client):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[5]}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top one
        assert entry.logprob <= 0
    comp = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=5,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5


def test_method_override_header(client):
    msgs = [{"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=msgs, max_tokens=4, extra_headers={"X-Specgate-Method": "none"})
    assert raw.headers["x-specgate-plan"] == "method=none;depth=0;reason=forced_by_request;source=rule"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                       extra_headers={"X-Specgate-Method": "mtp"})
    assert "available: none" in err.value.message


# -- cancellation and overload -------------------------------------------------------------


def _gauge(gateway, name: str, model: str) -> float:
    text = httpx.get(gateway.base_url + "/metrics").text
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _long_stream(gateway):
    return httpx.stream("POST", gateway.api + "/chat/completions", timeout=60, json={
        "model": "tiny-narrow", "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 1900, "temperature": 0, "stream": True, "ignore_eos": True})


def test_disconnect_frees_the_slot(gateway, client):
    with _long_stream(gateway) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert _gauge(gateway, "specgate_num_requests_running", "tiny-narrow") == 1
    # The client is gone: the engine must drop the request within a few steps.
    deadline = time.monotonic() + 10
    while _gauge(gateway, "specgate_num_requests_running", "tiny-narrow") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(gateway, "specgate_num_requests_running", "tiny-narrow") == 0
    out = client.chat.completions.create(model="tiny-narrow", max_tokens=4,
                                         messages=[{"role": "user", "content": "next"}])
    assert out.choices[0].finish_reason in ("length", "stop")
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert re.search(r'specgate_requests_total\{[^}]*model="tiny-narrow"[^}]*status="cancelled"', metrics)


def test_overload_gets_429_with_retry_after(gateway, client):
    with _long_stream(gateway) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model="tiny-narrow", max_tokens=4,
                                           messages=[{"role": "user", "content": "me too"}])
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert err.value.body["code"] == "overloaded"


def test_prefix_cache_reuses_prompts_and_turns(client):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about caches, in detail please."}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    # The whole prompt but its last token comes from the cache (hybrid
    # recurrent state cannot be trimmed, so that token is fed again).
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    turn2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Shorter."}]
    second = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_mtp_and_plain_give_the_same_text(gateway, client):
    prompt = "import os\nimport sys\n\n\ndef main():\n"
    texts, plans = {}, {}
    # mtp again after plain: it then starts from the prefix cache the plain
    # engine's thread filled (which once failed across threads).
    for key, method in (("mtp", "mtp"), ("none", "none"), ("mtp again", "mtp")):
        raw = client.completions.with_raw_response.create(
            model="demo", prompt=prompt, max_tokens=48, temperature=0,
            extra_headers={"X-Specgate-Method": method})
        plans[method] = raw.headers["x-specgate-plan"]
        texts[key] = raw.parse().choices[0].text
    assert texts["mtp"] == texts["none"] == texts["mtp again"] and texts["mtp"]
    assert plans == {"mtp": "method=mtp;depth=3;reason=forced_by_request;source=rule",
                     "none": "method=none;depth=0;reason=forced_by_request;source=rule"}
    # Unforced and alone on the model, the policy plans from what those
    # requests measured (on this CPU the demo's MTP usually loses).
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "def f():"}], max_tokens=8)
    assert re.fullmatch(r"method=(mtp;depth=[1-3];reason=spec_on|none;depth=0;reason=measured_loss)"
                        r";source=(live|explore|rule)", raw.headers["x-specgate-plan"])
    metrics = httpx.get(gateway.base_url + "/metrics").text
    drafts = re.search(
        r'^specgate_spec_decode_num_drafts_total\{method="mtp",model="demo"\} (\S+)$', metrics, re.M)
    assert drafts and float(drafts.group(1)) > 0
    accepted = re.search(
        r'^specgate_spec_decode_num_accepted_tokens_total\{method="mtp",model="demo"\} (\S+)$',
        metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0


def test_mtp_streams_sampled_and_seeded(client):
    kwargs = dict(model="demo", prompt="class Parser:\n", max_tokens=32, temperature=0.8, top_p=0.95,
                  seed=11)
    mtp = {"X-Specgate-Method": "mtp"}
    a = "".join(c.choices[0].text
                for c in client.completions.create(**kwargs, stream=True, extra_headers=mtp))
    b = client.completions.create(**kwargs, extra_headers=mtp).choices[0].text
    assert a == b and a  # a seeded request is reproducible on the MTP engine
    # and the same under plain batching, where the policy sends it under load
    # (each token is its seed's at its position, whatever the drafts were)
    plain = client.completions.create(**kwargs, extra_headers={"X-Specgate-Method": "none"})
    assert plain.choices[0].text == a


def test_an_image_in_a_tool_message_is_told_and_the_session_goes_on(client):
    """An image part in a tool message (not OpenAI's format, but clients
    relaying a screenshot tool send it) is told as a line, as Anthropic's
    tool_result images are, on any model: not a 400 that the history
    would repeat every turn."""
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    call = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}

    def history(result):
        return [{"role": "user", "content": "Look at the screen."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}]  # fmt: skip

    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    with_image = client.chat.completions.create(
        model="demo", messages=history([{"type": "text", "text": "screen:"}, image]),
        max_tokens=2, temperature=0)  # fmt: skip
    told = client.chat.completions.create(
        model="demo", messages=history("screen:" + TOOL_RESULT_IMAGE), max_tokens=2, temperature=0)
    assert with_image.usage.prompt_tokens == told.usage.prompt_tokens
    assert with_image.choices[0].message.content == told.choices[0].message.content
