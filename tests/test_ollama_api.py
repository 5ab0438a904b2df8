"""Ollama's API (/api/*) with the official `ollama` Python client, against
a real gateway with keys on: listing, show, ps, chat and generate, whole
and streamed, a tool call round trip parsed into ollama's own types,
`format` as a JSON schema, greedy answers equal to the OpenAI routes',
errors in Ollama's shape, and the same keys, model lists and quotas as
every other API.

One gateway for the module: "tiny" (the session's tiny checkpoint) and
"caller", a tool caller whose greedy answer to any chat is a call to
get_weather (tests/tool_caller.py)."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema_rs
import ollama
import openai
import pytest

from specgate.gateway.access.keys import add_key
from tests.conftest import start_gateway, stop_gateway
from tests.tool_caller import XML_TEMPLATE, build_tool_caller

KEEPALIVE_S = 0.2
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city.

    Args:
        city: The city's name
        days: How many days ahead
    """
    return "sunny"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("ollama")
    keys_file = work / "keys"
    keys = {
        "team": add_key(keys_file, "team"),
        "tiny-only": add_key(keys_file, "tiny-only", models=["tiny"]),
        "one-a-minute": add_key(keys_file, "one-a-minute", rpm=1),
        "admin": add_key(keys_file, "admin", admin=True),
    }
    caller = build_tool_caller(work / "caller", XML_TEMPLATE, CALL)
    gw = start_gateway(
        {"server": {"stream_keepalive_s": KEEPALIVE_S},
         "auth": {"keys_file": str(keys_file)},
         "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048,
                     "max_concurrent": 4},
                    {"id": "caller", "path": str(caller), "max_context": 2048},
                    # Unloaded under a stream by one test; a long context for a long prefill.
                    {"id": "spare", "path": str(tiny_model), "max_context": 8192}]},
        work,
    )  # fmt: skip
    gw.keys = keys
    yield gw
    stop_gateway(gw)


def client(server, key: str = "team") -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120,
                         headers={"Authorization": f"Bearer {server.keys[key]}"})  # fmt: skip


ASK = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 12}


def test_version_list_show_and_ps(server):
    assert httpx.head(server.base_url + "/", timeout=10).status_code == 200  # "is it up?"
    c = client(server)
    assert httpx.get(server.base_url + "/api/version", timeout=10,
                     headers={"Authorization": f"Bearer {server.keys['team']}"}
                     ).json()["version"].count(".") == 2  # fmt: skip
    listed = {m.model: m for m in c.list().models}
    assert set(listed) == {"tiny", "caller", "spare"}
    tiny = listed["tiny"]
    assert tiny.size > 0 and len(tiny.digest) == 64 and tiny.modified_at is not None
    assert tiny.details.format == "safetensors" and tiny.details.family
    assert tiny.details.parameter_size and tiny.details.quantization_level

    shown = c.show("caller")
    assert "tools" in shown.capabilities and "completion" in shown.capabilities
    assert "tools" not in c.show("tiny:latest").capabilities  # its template takes none
    arch = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{arch}.context_length"] == 2048
    assert "num_ctx 2048" in shown.parameters and "<tool_call>" in shown.template

    c.generate(model="tiny")  # no prompt: loads the model, as Ollama's does
    running = {m.model: m for m in c.ps().models}
    assert "tiny" in running
    assert running["tiny"].size > 0 and running["tiny"].context_length == 2048
    assert running["tiny"].expires_at is not None


def test_chat_whole_and_streamed_agree_and_match_the_openai_route(server):
    c = client(server)
    whole = c.chat(model="tiny", messages=ASK, stream=False, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    # What Ollama's clients send besides: accepted, and the answer is the same.
    parts = list(c.chat(model="tiny", messages=ASK, stream=True, options=GREEDY, think=True,
                        keep_alive="5m"))  # fmt: skip
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 12
    assert "".join(p.message.content or "" for p in parts) == whole.message.content

    oai = openai.OpenAI(base_url=server.api, api_key=server.keys["team"], max_retries=0)
    same = oai.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=12)
    assert same.choices[0].message.content == whole.message.content
    # /api/generate renders a prompt as a user turn through the same template.
    generated = c.generate(model="tiny", prompt=ASK[0]["content"], options=GREEDY)
    assert generated.response == whole.message.content
    # raw: the prompt as given, as /v1/completions takes it.
    raw = c.generate(model="tiny", prompt="The sea is", raw=True, options=GREEDY)
    plain = oai.completions.create(model="tiny", prompt="The sea is", temperature=0,
                                   max_tokens=12)  # fmt: skip
    assert raw.response == plain.choices[0].text


def test_num_ctx_bounds_the_answer_and_logprobs_come_per_token(server):
    c = client(server)
    n = c.chat(model="tiny", messages=ASK, stream=False, options=GREEDY).prompt_eval_count
    # -1: as long as the context allows, and num_ctx is the request's context.
    short = c.chat(model="tiny", messages=ASK, stream=False,
                   options={"temperature": 0, "num_ctx": n + 5, "num_predict": -1})  # fmt: skip
    assert (short.eval_count, short.done_reason) == (5, "length")
    scored = c.chat(model="tiny", messages=ASK, stream=False, logprobs=True, top_logprobs=2,
                    options=GREEDY)  # fmt: skip
    assert len(scored.logprobs) == 12 and all(len(lp.top_logprobs) == 2 for lp in scored.logprobs)
    # Greedy: each token is its position's most likely one.
    assert all(lp.logprob == max(t.logprob for t in lp.top_logprobs) for lp in scored.logprobs)


def test_a_tool_call_round_trip_in_ollamas_types(server):
    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # The client builds the tool's schema from the function itself.
    reply = c.chat(model="caller", messages=ask, tools=[get_weather], stream=False,
                   options={"temperature": 0})  # fmt: skip
    assert isinstance(reply, ollama.ChatResponse) and reply.done_reason == "stop"
    (call,) = reply.message.tool_calls
    assert isinstance(call, ollama.Message.ToolCall)
    assert (call.function.name, dict(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "days": 3})  # fmt: skip
    assert not reply.message.content

    streamed = [p for p in c.chat(model="caller", messages=ask, tools=[get_weather], stream=True,
                                  options={"temperature": 0}) if p.message.tool_calls]  # fmt: skip
    assert [tc.function.name for p in streamed for tc in p.message.tool_calls] == ["get_weather"]

    # The call's answer goes back as Ollama's clients send it: the assistant
    # message as received, then the tool's result by name.
    history = [*ask, reply.message,
               {"role": "tool", "content": get_weather(**call.function.arguments),
                "tool_name": "get_weather"}]  # fmt: skip
    again = c.chat(model="caller", messages=history, tools=[get_weather], stream=False,
                   options={"temperature": 0})  # fmt: skip
    assert again.message.tool_calls[0].function.name == "get_weather"  # its only answer


def test_format_with_a_json_schema_gives_valid_json(server):
    schema = {"type": "object", "additionalProperties": False, "required": ["kind", "ok"],
              "properties": {"kind": {"enum": ["sea", "lake"]}, "ok": {"type": "boolean"}}}  # fmt: skip
    c = client(server)
    for seed in range(3):
        reply = c.chat(model="tiny", messages=ASK, format=schema, stream=False,
                       options={"seed": seed, "num_predict": 64})  # fmt: skip
        assert reply.done_reason == "stop", reply
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(reply.message.content))
    streamed = c.generate(model="tiny", prompt="The sea", format="json", stream=True,
                          options={"temperature": 0, "num_predict": 24})  # fmt: skip
    assert "".join(p.response for p in streamed).startswith("{")


def test_bad_input_is_a_400_in_ollamas_shape_and_the_server_keeps_serving(server):
    c = client(server)
    with pytest.raises(ollama.ResponseError) as err:  # "tiny" is a text model: no images
        c.chat(model="tiny", messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}])
    assert err.value.status_code == 400 and "image" in err.value.error
    auth = {"Authorization": f"Bearer {server.keys['team']}"}
    for path, body, named in [
        ("/api/chat", {"model": "tiny", "messages": ASK, "options": {"temperature": "hot"}},
         "options.temperature"),
        ("/api/chat", {"model": "tiny", "messages": ASK, "options": {"num_ctx": 4096}},
         "options.num_ctx"),
        ("/api/chat", {"model": "tiny", "messages": ASK, "format": {"type": "nope"}}, "format"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "context": [1, 2]}, "context"),
        ("/api/chat", {"model": "nope", "messages": ASK}, "does not exist"),
        ("/api/embed", {"model": "tiny", "input": "x"}, "embeddings"),
        ("/api/pull", {"model": "llama3"}, "config"),
        ("/api/chat", "{not json", "not valid JSON"),
    ]:  # fmt: skip
        # As `curl -d` sends it (Ollama's docs do): JSON, said to be a form.
        send = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(
            server.base_url + path,
            content=send,
            timeout=30,
            headers=auth | {"Content-Type": "application/x-www-form-urlencoded"},
        )
        status = 404 if named == "does not exist" else 400
        error = r.json()["error"]  # Ollama's shape: the message alone
        assert r.status_code == status and list(r.json()) == ["error"], (path, r.text)
        assert isinstance(error, str) and named in error, r.text
    assert c.chat(model="tiny", messages=ASK, stream=False, options=GREEDY).eval_count == 12


def test_keys_model_lists_and_quotas_apply(server):
    with pytest.raises(ollama.ResponseError) as err:  # no key
        ollama.Client(host=server.base_url).list()
    assert err.value.status_code == 401 and "API key" in err.value.error
    narrow = client(server, "tiny-only")
    assert [m.model for m in narrow.list().models] == ["tiny"]
    with pytest.raises(ollama.ResponseError) as err:
        narrow.chat(model="caller", messages=ASK)
    assert err.value.status_code == 403
    sparing = client(server, "one-a-minute")
    sparing.generate(model="tiny", prompt="hi", options={"num_predict": 1})
    with pytest.raises(ollama.ResponseError) as err:
        sparing.generate(model="tiny", prompt="hi", options={"num_predict": 1})
    assert err.value.status_code == 429


def test_keepalives_parse_and_an_error_mid_stream_is_a_last_error_line(server):
    """A slow first token (a long prompt's prefill) is preceded by empty
    chunks the client parses, not by bytes it would choke on; the model
    unloaded under the stream ends it with an error line, which the client
    raises."""
    c = client(server)
    long = [{"role": "user", "content": "waves and tides " * 500}]  # about 4,000 tokens
    stream = c.chat(model="spare", messages=long, stream=True,
                    options={"temperature": 0, "num_predict": -1})  # fmt: skip
    t0, alive = time.monotonic(), []
    for part in stream:
        assert isinstance(part, ollama.ChatResponse) and not part.done
        if part.message.content or len(alive) == 3:
            break
        alive.append(time.monotonic() - t0)
    assert alive, "the prefill outlasted the keep-alive period, so one came first"
    assert max(b - a for a, b in zip([0.0, *alive], alive, strict=False)) < 5.0, alive
    admin = {"Authorization": f"Bearer {server.keys['admin']}"}
    r = httpx.post(server.base_url + "/admin/models/spare/unload", headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(ollama.ResponseError) as err:
        for _ in stream:
            pass
    assert "unloaded" in err.value.error
