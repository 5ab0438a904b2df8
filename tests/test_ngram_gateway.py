"""Self-drafting behind the gateway: ngram and mtp+ngram forced, planned, exact, measured.

A real `specgate serve` with the shipped demo model (it falls into loops of
its own text, which is what a copy from the context catches), driven by the
real openai and anthropic SDKs.
"""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from tests.conftest import start_gateway, stop_gateway

MODEL = "demo-ngram"
PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = start_gateway({"models": [
        {"id": MODEL, "path": "builtin:demo", "ngram_depth": 6, "mtp_depth": 2,
         "engines": ["mlx_plain", "mlx_mtp", "mlx_ngram", "mlx_mtp_ngram"]},
    ]}, tmp_path_factory.mktemp("gw-ngram"))  # fmt: skip
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)


def counters(gw, method: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(gw.base_url + "/metrics").text.splitlines():
        m = re.match(r'specgate_spec_decode_(\w+)_total\{method="([^"]+)",model="([^"]+)"\} (\S+)', line)
        if m and m[2] == method and m[3] == MODEL:
            out[m[1]] = float(m[4])
    return out


def greedy(client, method: str, n: int = 96) -> tuple[list[int], str]:
    r = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=n, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers={"X-Specgate-Method": method})  # fmt: skip
    return r.parse().choices[0].token_ids, r.headers["x-specgate-plan"]


@pytest.mark.parametrize("method,depth", [("ngram", 6), ("mtp+ngram", 6)])
def test_forced_self_drafting_equals_plain_and_is_counted(gw, client, method, depth):
    plain, _ = greedy(client, "none")
    before = counters(gw, method)
    got, plan = greedy(client, method)
    assert plan == f"method={method};depth={depth};reason=forced_by_request;source=rule"
    assert got == plain and len(plain) == 96
    after = counters(gw, method)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # The demo repeats itself within 96 tokens: copies were made and kept.
    assert grew["num_drafts"] > 0 and 0 < grew["num_accepted_tokens"] <= grew["num_draft_tokens"]
    print(f"[{method}: {grew['num_accepted_tokens']:.0f}/{grew['num_draft_tokens']:.0f} accepted "
          f"in {grew['num_drafts']:.0f} rounds, {grew.get('num_undrafted_rounds', 0):.0f} rounds "
          f"with nothing to copy]", end=" ")


def test_streamed_chat_with_ngram_equals_plain(client):
    msgs = [{"role": "user", "content": "Repeat this function:\n\n" + PROMPT + "    return {}\n"}]
    texts = {}
    for method in ("none", "ngram"):
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=64, temperature=0, stream=True,
            extra_headers={"X-Specgate-Method": method})  # fmt: skip
        texts[method] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert texts["ngram"] == texts["none"] and texts["none"]


def test_anthropic_messages_with_ngram_equal_plain(gw):
    client = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0, timeout=120)
    texts = {}
    for method in ("none", "ngram"):
        r = client.messages.create(
            model=MODEL, max_tokens=48, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "Write a function that reads a file."}],
            extra_headers={"X-Specgate-Method": method})  # fmt: skip
        texts[method] = r.content[0].text
    assert texts["ngram"] == texts["none"] and texts["none"]


def test_a_seeded_request_gives_one_text_on_every_engine(client):
    """Sampled with a seed, plain batching, the MTP head, copies and both
    give the same tokens: each is its seed's at its position, whatever was
    drafted (and however much of a copy the evidence let through)."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0.8, top_p=0.95, seed=5,
              extra_body={"return_token_ids": True})  # fmt: skip
    methods = ("none", "mtp", "ngram", "mtp+ngram", "ngram")  # ngram twice: a rerun too
    got = [client.completions.create(**kw, extra_headers={"X-Specgate-Method": m}).choices[0]
           .token_ids for m in methods]  # fmt: skip
    assert len(got[0]) == 48
    differ = [m for m, g in zip(methods, got, strict=True) if g != got[0]]
    assert not differ, differ


def test_the_policy_may_plan_ngram_and_says_why(client):
    """Idle and unforced, the plan is one of the model's methods, from a rule,
    a measurement or an exploration; never a method the model lacks."""
    r = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                                    temperature=0)
    assert re.fullmatch(r"method=(none|mtp|ngram|mtp\+ngram);depth=\d+;reason=\w+;"
                        r"source=(rule|live|tune|explore)", r.headers["x-specgate-plan"])


def test_an_ngram_engine_on_a_model_without_an_mtp_head(tmp_path):
    """mlx_ngram needs nothing from the checkpoint (a dense Qwen3 with no MTP
    head serves it); mlx_mtp_ngram needs the head, and a checkpoint without
    one fails to load, saying so, rather than serving quietly without it."""
    from specgate.builders.tiny import build_qwen3_dense

    dense = build_qwen3_dense(tmp_path / "dense")
    g = start_gateway({"models": [{"id": "dense", "path": str(dense),
                                   "engines": ["mlx_plain", "mlx_ngram"]}]}, tmp_path)  # fmt: skip
    try:
        c = openai.OpenAI(base_url=g.api, api_key="none", max_retries=0, timeout=120)
        r = c.completions.with_raw_response.create(model="dense", prompt=[5, 6, 7, 5, 6, 7, 5, 6],
                                                   max_tokens=16, temperature=0,
                                                   extra_headers={"X-Specgate-Method": "ngram"})
        assert r.headers["x-specgate-plan"].startswith("method=ngram;")
        assert r.parse().usage.completion_tokens == 16
    finally:
        stop_gateway(g)
    (tmp_path / "second").mkdir()
    with pytest.raises(RuntimeError, match="dense-mtp-ngram failed to load: .*no MTP head"):
        start_gateway({"models": [{"id": "dense-mtp-ngram", "path": str(dense),
                                   "engines": ["mlx_plain", "mlx_mtp_ngram"]}]},
                      (tmp_path / "second").resolve())  # fmt: skip
