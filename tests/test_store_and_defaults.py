"""What one API key keeps, and what a request that sets no limit gets.

The Responses store (previous_response_id) is partitioned by key, each key
within its own quota of responses and bytes, and keeps only the fields the
API defines: through a real gateway with two keys and a small quota, and
the store class itself for its eviction order. Without max_tokens,
/v1/completions generates OpenAI's 16 tokens, chat completions and
responses the model's `default_max_tokens`, never the whole context.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway

from specgate.gateway.access.keys import add_key
from specgate.gateway.api.responses_api import ResponseStore
from specgate.gateway.api.responses_schema import MessageItem

PER_KEY = 3  # responses a key keeps
BYTES_PER_KEY = 1024
DEFAULT_MAX_TOKENS = 5  # the model's, in this gateway


@pytest.fixture(scope="module")
def gateway(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("store")
    keys = {name: add_key(work / "keys", name) for name in ("alice", "bob")}
    gw = start_gateway(
        {"server": {"responses_store": {"responses_per_key": PER_KEY,
                                        "bytes_per_key": f"{BYTES_PER_KEY}B"}},
         "auth": {"keys_file": str(work / "keys")},
         "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048,
                     "default_max_tokens": DEFAULT_MAX_TOKENS}]},
        work,
    )  # fmt: skip
    gw.keys = keys
    yield gw
    stop_gateway(gw)


def client(gateway, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.api, api_key=gateway.keys[name], max_retries=0)


def respond(c: openai.OpenAI, **kw):
    return c.responses.create(**{"model": "tiny", "input": "hi", "max_output_tokens": 1} | kw)


def test_one_keys_traffic_never_evicts_another_keys_responses(gateway):
    alice, bob = client(gateway, "alice"), client(gateway, "bob")
    bobs = respond(bob)
    alices = [respond(alice) for _ in range(PER_KEY + 1)]  # one past alice's quota
    with pytest.raises(openai.NotFoundError) as gone:
        respond(alice, previous_response_id=alices[0].id)  # her least recently used
    assert gone.value.body["param"] == "previous_response_id"
    assert f"{PER_KEY} responses" in gone.value.body["message"]
    assert respond(alice, previous_response_id=alices[-1].id).status
    # Bob's one response outlived all of alice's traffic, and is his alone.
    follow = respond(bob, input="and?", previous_response_id=bobs.id)
    assert follow.usage.input_tokens > bobs.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        respond(alice, previous_response_id=bobs.id)


def test_only_the_fields_the_api_defines_are_stored(gateway):
    """Unknown fields on an item and on its content parts, far beyond the
    key's byte quota, are accepted and not stored: the response is kept and
    continues. A response whose own items exceed the quota is not kept."""
    alice = client(gateway, "alice")
    padding = "x" * BYTES_PER_KEY
    padded = respond(alice, input=[
        {"type": "message", "role": "user", "padding": padding, "status": "completed",
         "content": [{"type": "input_text", "text": "hi", "padding": padding}]}])  # fmt: skip
    follow = respond(alice, input="and?", previous_response_id=padded.id)
    assert follow.usage.input_tokens > padded.usage.input_tokens

    big = respond(alice, input="hi " + padding)
    with pytest.raises(openai.NotFoundError):
        respond(alice, previous_response_id=big.id)
    assert respond(alice, input="more", previous_response_id=follow.id).status  # not evicted by it


def test_store_evicts_least_recently_used_within_a_key():
    store = ResponseStore(responses_per_key=3, bytes_per_key=1100)
    item = [MessageItem(role="user", content="x" * 200)]  # 247 bytes as JSON
    store.put("a", "r1", None, item)
    store.put("a", "r2", "r1", item)
    store.put("b", "s1", None, item)
    assert store.conversation("a", "r2") == item + item  # uses r2, then r1, its parent
    store.put("a", "r3", None, item)
    store.put("a", "r4", None, item)  # over a's count: its least recently used, r2, goes
    assert [store.holds("a", r) for r in ("r1", "r2", "r3", "r4")] == [True, False, True, True]
    assert store.holds("b", "s1") and not store.holds("b", "r1")
    store.put("a", "r5", "r1", item * 3)  # over a's count (r1 goes), then its bytes (r3)
    assert [store.holds("a", r) for r in ("r1", "r3", "r4", "r5")] == [False, False, True, True]
    assert store.conversation("a", "r5") is None  # its chain lost a link
    store.put("b", "huge", None, item * 5)  # alone over the quota: not kept, nothing evicted
    assert not store.holds("b", "huge") and store.holds("b", "s1")


def test_what_a_request_without_a_limit_generates(gateway):
    headers = {"Authorization": f"Bearer {gateway.keys['alice']}"}

    def post(path: str, body: dict) -> dict:
        r = httpx.post(gateway.api + path, json={"model": "tiny", "temperature": 0} | body,
                       headers=headers, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    completion = post("/completions", {"prompt": "def main():", "ignore_eos": True})
    assert completion["usage"]["completion_tokens"] == 16  # OpenAI's documented default
    assert completion["choices"][0]["finish_reason"] == "length"
    chat = post(
        "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    )
    assert chat["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS  # the model's
    assert chat["choices"][0]["finish_reason"] == "length"
    response = post("/responses", {"input": "hi"})
    assert response["usage"]["output_tokens"] == DEFAULT_MAX_TOKENS
    assert response["status"] == "incomplete"


def test_a_limit_past_the_context_is_what_the_context_leaves(gateway):
    """max_tokens is an upper bound, as llama-server and Ollama take it:
    Claude Code asks for 32000 whatever its prompt, and a 400 ended its turns
    once a conversation grew past the context less that. Generation stops
    where the context ends, as `length`; a prompt with no room is still a
    400, in the words Claude Code compacts on."""
    ant = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.keys["alice"],
                              max_retries=0)  # fmt: skip
    prompt = [10 + i % 1000 for i in range(2048 - 5)]  # 5 tokens of room
    r = httpx.post(gateway.api + "/completions", timeout=120,
                   headers={"Authorization": f"Bearer {gateway.keys['alice']}"},
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 32000,
                         "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"
    msg = ant.messages.create(model="tiny", max_tokens=32000, timeout=120,
                              messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        ant.messages.create(model="tiny", max_tokens=10,
                            messages=[{"role": "user", "content": "hi " * 3000}])  # fmt: skip
