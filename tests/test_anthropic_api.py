"""The Anthropic Messages API end to end: real uvicorn, the real `anthropic` SDK."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from specgate.gateway.serving.images import TOOL_RESULT_IMAGE

MSG = [{"role": "user", "content": "def fibonacci(n):"}]
# anthropic 2.14's create() has no sampling arguments (newer Claude models
# refuse them); the API still defines them, so they go in the body.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture
def client(gateway):
    return anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0,
                               timeout=120)  # fmt: skip


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(usage) -> int:
    """The whole prompt: Anthropic counts what came from the prefix cache apart."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)

def test_non_streaming_message(client):
    msg = client.messages.create(model="tiny", max_tokens=24, messages=MSG, metadata={"user_id": "someone"},
                                 **GREEDY)  # fmt: skip
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 24


def test_greedy_equals_openai_endpoint(client, oai):
    for max_tokens in (8, 40):
        msg = client.messages.create(model="tiny", max_tokens=max_tokens, messages=MSG,
                                     **GREEDY)  # fmt: skip
        chat = oai.chat.completions.create(model="tiny", max_tokens=max_tokens, messages=MSG,
                                           temperature=0)  # fmt: skip
        assert msg.content[0].text == chat.choices[0].message.content
        assert prompt_tokens(msg.usage) == chat.usage.prompt_tokens
        assert msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens_details.cached_tokens
        assert msg.usage.output_tokens == chat.usage.completion_tokens
        want = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
        assert msg.stop_reason == want


def test_max_tokens_stop_reason(client):
    msg = client.messages.create(model="tiny", max_tokens=3, messages=MSG, **GREEDY,
                                 extra_headers={"anthropic-version": "2023-06-01"})  # fmt: skip
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_stream_helper_equals_non_streaming(client):
    kw = dict(model="tiny", max_tokens=32, messages=MSG, **GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_raw_stream_event_sequence(gateway, client):
    kw = dict(model="tiny", max_tokens=16, messages=MSG, stream=True)
    events = list(client.messages.create(**kw, **GREEDY))
    kinds = [e.type for e in events]  # the SDK drops pings
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens")
    assert events[-2].usage.output_tokens > 0
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    # On the wire: each event named, the ping right after the first block starts.
    with httpx.stream("POST", gateway.base_url + "/v1/messages", json=kw | GREEDY["extra_body"],
                      headers={"anthropic-version": "2023-06-01"}, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert [n for n in names if n != "ping"] == kinds


def test_system_prompt_changes_prompt_tokens(client):
    plain = client.messages.count_tokens(model="tiny", messages=MSG)
    as_string = client.messages.count_tokens(model="tiny", messages=MSG, system="Be brief.")
    as_blocks = client.messages.count_tokens(
        model="tiny", messages=MSG, system=[{"type": "text", "text": "Be brief."}]
    )
    assert as_string.input_tokens == as_blocks.input_tokens > plain.input_tokens
    msg = client.messages.create(model="tiny", max_tokens=4, messages=MSG, system="Be brief.",
                                 **GREEDY)  # fmt: skip
    assert prompt_tokens(msg.usage) == as_string.input_tokens


def test_count_tokens_equals_usage_for_block_content(client):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "class Parser:"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": {
            "type": "ephemeral"}}]},
    ]  # fmt: skip
    counted = client.messages.count_tokens(model="tiny", messages=messages)
    msg = client.messages.create(model="tiny", max_tokens=4, messages=messages, **GREEDY)
    assert counted.input_tokens == prompt_tokens(msg.usage)


def _cancelled(gateway) -> float:
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specgate_requests_total{") and 'status="cancelled"' in line)


def test_stop_sequences(gateway, client):
    cancelled = _cancelled(gateway)
    free = client.messages.create(model="tiny", max_tokens=40, messages=MSG, **GREEDY)
    text = free.content[0].text
    assert len(text) > 6, text
    stop = text[3:6]
    msg = client.messages.create(model="tiny", max_tokens=40, messages=MSG, **GREEDY,
                                 stop_sequences=["never-there", stop])  # fmt: skip
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]
    with client.messages.stream(model="tiny", max_tokens=40, messages=MSG, **GREEDY,
                                stop_sequences=[stop]) as stream:  # fmt: skip
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == msg.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert _cancelled(gateway) == cancelled  # a stop sequence is a finished request


def test_sampling_parameters_accepted(client):
    msg = client.messages.create(model="tiny", max_tokens=8, messages=MSG,
                                 extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20})  # fmt: skip
    assert msg.usage.output_tokens >= 1


WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}

BAD = {
    "empty messages": dict(messages=[]),
    "max_tokens 0": dict(max_tokens=0),
    "temperature above 1": dict(extra_body={"temperature": 1.5}),
    "temperature below 0": dict(extra_body={"temperature": -0.1}),
    "top_p above 1": dict(extra_body={"top_p": 1.2}),
    "top_k negative": dict(extra_body={"top_k": -1}),
    # (a system message itself is taken: Claude Code sends one mid-conversation)
    "system message with a tool result": dict(messages=[*MSG, {"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
    "unknown block type": dict(messages=[{"role": "user", "content": [{"type": "video"}]}]),
    "image block": dict(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]),
    "last message from assistant": dict(messages=[*MSG, {"role": "assistant", "content": "x"}]),
    "tools on a template without tools": dict(tools=[{"name": "f", "input_schema": {
        "type": "object"}}]),
    "tool choice without a name": dict(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                       tool_choice={"type": "tool"}),
    "thinking budget not a number": dict(thinking={"type": "enabled", "budget_tokens": "lots"}),
    "thinking in a user message": dict(messages=[{"role": "user", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "x"}]}]),
    "too many stop sequences": dict(stop_sequences=[f"s{i}" for i in range(40)]),
    "a client tool without a schema": dict(tools=[{"name": "f"}]),
    "forcing Anthropic's own tool": dict(tools=[WEB_SEARCH], tool_choice={
        "type": "tool", "name": "web_search"}),
    # (max_tokens past the context is what the context leaves:
    # test_store_and_defaults.py)
}  # fmt: skip


def test_anthropics_own_tools_are_left_out_and_the_request_served(client):
    """Anthropic's server tools (web_search, ...) and its schema-less client
    tools (bash, text_editor) cannot run here: left out of what the model
    sees, not a 400 that ends the session; their records in the history
    (server_tool_use, web_search_tool_result) are left out of the context."""
    history = [*MSG, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
         "input": {"query": "specgate"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
            {"type": "web_search_result", "url": "https://example.com", "title": "x",
             "encrypted_content": "b3BhcXVl"}]},
        {"type": "text", "text": "Found it."}]}, {"role": "user", "content": "Thanks."}]  # fmt: skip
    tools = [WEB_SEARCH, {"type": "bash_20250124", "name": "bash"}]
    # "tiny"'s template takes no tools: only Anthropic's are given, and left out.
    msg = client.messages.create(model="tiny", max_tokens=4, messages=history, tools=tools,
                                 **GREEDY)  # fmt: skip
    assert msg.usage.output_tokens >= 1 and {b.type for b in msg.content} <= {"text"}
    counted = client.messages.count_tokens(model="tiny", messages=history, tools=tools)
    plain = client.messages.count_tokens(model="tiny", messages=[*MSG, {
        "role": "assistant", "content": "Found it."}, {"role": "user", "content": "Thanks."}])  # fmt: skip
    assert counted.input_tokens == plain.input_tokens
    # Beside a client tool, on a model that takes tools: that one is shown.
    read = {"name": "read_file", "input_schema": {"type": "object", "properties": {
        "path": {"type": "string"}}}}  # fmt: skip
    msg = client.messages.create(model="demo", max_tokens=4, messages=MSG,
                                 tools=[WEB_SEARCH, read], **GREEDY)  # fmt: skip
    assert msg.usage.input_tokens > client.messages.count_tokens(
        model="demo", messages=MSG).input_tokens


def test_an_image_in_a_tool_result_is_told_and_the_session_goes_on(client):
    """Claude Code's Read of a PNG answers with an image block in the
    tool_result, and the history keeps it in every later turn: the model is
    told an image was left out (a tool turn holds text) rather than the
    session ending in a 400."""
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="

    def history(result):
        read = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
        return [*MSG, {"role": "assistant", "content": [read]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": result}]}]  # fmt: skip

    read = {"name": "Read", "input_schema": {"type": "object", "properties": {
        "file_path": {"type": "string"}}}}  # fmt: skip
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    with_image = history([{"type": "text", "text": "a.png:"}, image])
    msg = client.messages.create(model="demo", max_tokens=4, messages=with_image, tools=[read],
                                 **GREEDY)  # fmt: skip
    assert msg.usage.output_tokens >= 1
    told = history("a.png:" + TOOL_RESULT_IMAGE)
    assert (client.messages.count_tokens(model="demo", messages=with_image, tools=[read]).input_tokens
            == client.messages.count_tokens(model="demo", messages=told, tools=[read]).input_tokens)  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_anthropic_400s(client, case):
    kw = dict(model="tiny", max_tokens=4, messages=MSG) | BAD[case]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**kw)
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "disabled"},
                                      {"type": "enabled", "budget_tokens": 1024}])  # fmt: skip
def test_thinking_in_any_form_is_served_without_thinking(client, thinking):
    """Claude Code sends `thinking: {"type": "adaptive"}` on every turn (it
    was a 400); a model that cannot think answers, with no thinking blocks.
    An earlier turn's thinking blocks, sent back with their signatures, are
    taken (and left out of the context, as Anthropic does)."""
    history = [*MSG, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me see.", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Hello."}]}, {"role": "user", "content": "Again."}]  # fmt: skip
    msg = client.messages.create(model="tiny", max_tokens=4, messages=history,
                                 thinking=thinking, **GREEDY)  # fmt: skip
    assert msg.usage.output_tokens >= 1
    assert {b.type for b in msg.content} <= {"text"}
    counted = client.messages.count_tokens(model="tiny", messages=history, thinking=thinking)
    plain = client.messages.count_tokens(model="tiny", messages=[*MSG, {
        "role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again."}])  # fmt: skip
    assert counted.input_tokens == plain.input_tokens  # the thinking left out


def test_error_shapes_and_still_serving(gateway, client):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MSG)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=MSG)
    # max_tokens is required; the SDK enforces it too, so send the body raw.
    raw = httpx.post(gateway.base_url + "/v1/messages", json={"model": "tiny", "messages": MSG})
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    assert "max_tokens" in raw.json()["error"]["message"]
    bad_json = httpx.post(gateway.base_url + "/v1/messages", content=b"{nope",
                          headers={"content-type": "application/json"})  # fmt: skip
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == (
        "invalid_request_error")  # fmt: skip
    msg = client.messages.create(model="tiny", max_tokens=4, messages=MSG, **GREEDY)
    assert msg.usage.output_tokens >= 1
    assert gateway.alive() and "Traceback" not in gateway.log()
