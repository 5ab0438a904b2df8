"""GGUF models served through specgate by real llama-server processes.

The gateway is a real `specgate serve`; llama-server is specgate's own build
(the llama_server_binary fixture runs `install-llama-server` once per
machine); the client is the openai SDK. "demo-gguf" is the shipped demo
model exported to GGUF with its trained MTP head as nextn layers, so
draft-mtp really drafts, and some drafts are rejected; on the shared
gateway it also runs an n-gram process (llamacpp_ngram), which copies the
loops the demo falls into.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from specgate.builders.gguf_export import export_gguf
from tests.conftest import REPO, listening_ports, start_gateway, stop_gateway
from tests.tool_caller import HERMES_TEMPLATE

pytestmark = pytest.mark.timeout(1800)  # the first use on a machine builds llama-server

PROMPTS = [
    "def fibonacci(n):",
    "Write a function that sorts a list.",
    "import numpy as np\n\n",
    "The river was",
    "class Stack:\n    def __init__(self):",
    "Explain recursion.",
]


@pytest.fixture(scope="module")
def ar_gguf(tiny_model, tmp_path_factory) -> Path:
    """A GGUF with no MTP layers (the trunk only)."""
    return export_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "ar-only.gguf",
                       include_mtp=False)


def gguf_models(ar_gguf: Path) -> list[dict]:
    """Each llama-server on one thread: its barriers spin when its threads
    outnumber the cores the suite's other workers leave (docs/DESIGN.md, Testing)."""
    return [
        {"id": "demo-gguf", "path": "builtin:demo-gguf", "engines": ["llamacpp", "llamacpp_mtp"],
         "mtp_depth": 3, "max_concurrent": 2, "max_context": 1024, "llamacpp": {"threads": 1}},
        {"id": "ar-gguf", "path": str(ar_gguf), "engines": ["llamacpp", "llamacpp_mtp"],
         "max_concurrent": 1, "max_context": 512, "llamacpp": {"threads": 1}},
    ]


@pytest.fixture(scope="module")
def gw(ar_gguf, llama_server_binary, tmp_path_factory):
    models = gguf_models(ar_gguf)
    models[0]["engines"] = ["llamacpp", "llamacpp_mtp", "llamacpp_ngram"]
    # The trunk-only GGUF takes tools, through a hermes template of our own.
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    models[1]["llamacpp"]["extra_args"] = ["--chat-template-file", str(template)]
    g = start_gateway(
        {"llama_server": {"binary": str(llama_server_binary)},
         "models": models + [{"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain"]}]},
        tmp_path_factory.mktemp("gw-llamacpp"),
    )
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)


def llama_servers(gateway_pid: int) -> dict[str, int]:
    """The gateway's llama-server children: 'model:plain' / ':mtp' / ':ngram' -> pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != gateway_pid or not cmd[0].endswith(b"llama-server"):
            continue
        model = Path(cmd[cmd.index(b"-m") + 1].decode()).stem
        spec = cmd[cmd.index(b"--spec-type") + 1] if b"--spec-type" in cmd else None
        kind = "plain" if spec is None else "mtp" if spec == b"draft-mtp" else "ngram"
        found[f"{model}:{kind}"] = int(entry.name)
    return found


def spec_counters(gw, method: str = "llamacpp_mtp") -> dict[str, float]:
    text = httpx.get(gw.base_url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("specgate_spec_decode") and f'method="{method}"' in line \
                and 'model="demo-gguf"' in line and "_total" in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def greedy_ids(client, model: str, prompt: str, method: str, n: int = 64) -> list[int]:
    r = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers={"X-Specgate-Method": method},
    )
    assert r.headers["x-specgate-plan"].startswith(f"method={method};")
    return r.parse().choices[0].token_ids


# -- serving ----------------------------------------------------------------------


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    r = client.chat.completions.with_raw_response.create(
        model="demo-gguf", messages=msgs, max_tokens=24, temperature=0)
    assert r.headers["x-specgate-plan"] == "method=llamacpp_mtp;depth=3;reason=spec_on;source=rule"
    full = r.parse()
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    text = full.choices[0].message.content
    assert text

    stream = client.chat.completions.create(
        model="demo-gguf", messages=msgs, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # streamed


def test_greedy_draft_mtp_equals_llama_server_without_speculation(client, gw):
    before = spec_counters(gw)
    for prompt in PROMPTS:
        plain = greedy_ids(client, "demo-gguf", prompt, "none")
        spec = greedy_ids(client, "demo-gguf", prompt, "llamacpp_mtp")
        assert len(plain) == 64 and spec == plain, prompt
    after = spec_counters(gw)

    def grew(name):
        key = f'specgate_spec_decode_{name}_total{{method="llamacpp_mtp",model="demo-gguf"}}'
        return after.get(key, 0) - before.get(key, 0)

    drafted, accepted = grew("num_draft_tokens"), grew("num_accepted_tokens")
    print(f"\ndraft-mtp over {len(PROMPTS)} prompts: {accepted:.0f}/{drafted:.0f} drafts accepted")
    # The comparison means something only if drafts were both kept and thrown away.
    assert 0 < accepted < drafted
    per_pos = sum(v - before.get(k, 0) for k, v in after.items() if "per_pos" in k)
    assert per_pos == accepted
    assert grew("num_drafts") > 0


def test_greedy_ngram_equals_llama_server_without_speculation(client, gw):
    """llama-server's n-gram speculation (its own process), forced per request:
    the tokens are plain decoding's, and its drafts are counted under
    method="llamacpp_ngram"."""
    before = spec_counters(gw, "llamacpp_ngram")
    for prompt in PROMPTS[:3]:
        plain = greedy_ids(client, "demo-gguf", prompt, "none", n=128)
        spec = greedy_ids(client, "demo-gguf", prompt, "llamacpp_ngram", n=128)
        assert len(plain) == 128 and spec == plain, prompt
    after = spec_counters(gw, "llamacpp_ngram")

    def grew(name):
        key = f'specgate_spec_decode_{name}_total{{method="llamacpp_ngram",model="demo-gguf"}}'
        return after.get(key, 0) - before.get(key, 0)

    drafted, accepted = grew("num_draft_tokens"), grew("num_accepted_tokens")
    print(f"\nllamacpp_ngram over 3 prompts: {accepted:.0f}/{drafted:.0f} drafts accepted")
    assert grew("num_drafts") > 0 and 0 < accepted <= drafted
    # A client need not know the backend: "ngram" (and "mtp") name llama-server's own.
    for asked, method in (("ngram", "llamacpp_ngram"), ("mtp", "llamacpp_mtp")):
        r = client.completions.with_raw_response.create(
            model="demo-gguf", prompt=PROMPTS[0], max_tokens=16, temperature=0,
            extra_headers={"X-Specgate-Method": asked})  # fmt: skip
        assert r.headers["x-specgate-plan"].startswith(f"method={method};")
        assert r.parse().choices[0].text
    # A method no engine of the model answers to: a 400 naming the ones it has.
    with pytest.raises(openai.BadRequestError, match="available: .*llamacpp_ngram"):
        client.completions.create(model="demo-gguf", prompt="a", max_tokens=2,
                                  extra_headers={"X-Specgate-Method": "dflash"})


def test_same_prompt_tokens_in_both_worlds(client):
    """The demo served by MLX and by llama-server sees the same prompt tokens
    (chat template and tokenizer agree), and starts its answer the same way."""
    msgs = [{"role": "user", "content": "Write a function that sorts a list."}]
    got = {}
    for model in ("demo", "demo-gguf"):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                           temperature=0, extra_body={"return_token_ids": True})
        got[model] = (r.usage.prompt_tokens, r.choices[0].token_ids)
    assert got["demo"][0] == got["demo-gguf"][0]
    # bf16 MLX vs f32 llama.cpp: the first token is far from any tie on this prompt.
    assert got["demo"][1][0] == got["demo-gguf"][1][0]


def test_demo_gguf_takes_tools_as_mlx_renders_them(client):
    """The demo's tool template goes into its GGUF (builtin:demo-gguf), and
    llama-server's Jinja renders a tool turn, results and all, to the same
    tokens as transformers does for the MLX engines. (With a description:
    llama-server gives a tool without one an empty "description".)"""
    tools = [{"type": "function", "function": WEATHER["function"] | {"description": "Forecast."}}]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]  # fmt: skip
    prompt = {}
    for model in ("demo", "demo-gguf"):
        r = client.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=2,
                                           temperature=0)  # fmt: skip
        prompt[model] = r.usage.prompt_tokens
    assert prompt["demo"] == prompt["demo-gguf"] > 100, prompt


def test_sampled_and_seeded(client):
    kw = dict(model="demo-gguf", prompt="The river was", max_tokens=24, temperature=0.9,
              top_p=0.95, seed=11)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same server: same sample
    texts = {client.completions.create(**kw | {"seed": s}).choices[0].text for s in range(4)}
    assert len(texts) > 1


def test_what_llama_cpp_cannot_honour(client):
    # No engine of this model applies OpenAI's presence penalty: a clear 400.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-gguf", prompt="a", max_tokens=4, presence_penalty=0.5)
    assert e.value.body["param"] == "presence_penalty" and "prompt" in e.value.body["message"]
    # Logprobs: draft-mtp has none, so the plan falls back to the plain server.
    r = client.chat.completions.with_raw_response.create(
        model="demo-gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    assert r.headers["x-specgate-plan"] == "method=none;depth=0;reason=unsupported_params;source=rule"
    lps = r.parse().choices[0].logprobs.content
    assert len(lps) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lps)
    # ... unless the request insists on draft-mtp.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo-gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            logprobs=True, extra_headers={"X-Specgate-Method": "llamacpp_mtp"})
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="fixed when its server starts"):
        client.completions.create(model="demo-gguf", prompt="a", max_tokens=4,
                                  extra_headers={"X-Specgate-Depth": "5"})


SYMBOL = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "line": {"type": "integer", "minimum": 1, "maximum": 9999},
                   "kind": {"enum": ["function", "class"]}},
    "required": ["name", "line", "kind"], "additionalProperties": False,
}  # fmt: skip


def test_json_schema_through_llama_server(client):
    """response_format goes to llama-server as its json_schema: greedy, the
    output validates, with draft-mtp as without; above temperature
    0 (where llama.cpp's grammar sampling is not the masked distribution)
    and for grammars that are not a JSON schema, a clear 400."""
    import jsonschema_rs

    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SYMBOL, "strict": True}}
    for prompt in PROMPTS[:3]:
        texts = []
        for method in ("none", "llamacpp_mtp"):
            r = client.chat.completions.create(
                model="demo-gguf", messages=[{"role": "user", "content": prompt}], max_tokens=120,
                temperature=0, response_format=fmt, extra_headers={"X-Specgate-Method": method})
            assert r.choices[0].finish_reason == "stop"
            texts.append(r.choices[0].message.content)
        # Not compared with each other: llama.cpp's greedy text changes with
        # its prompt cache (the second request hits it) and with draft-mtp, by
        # a space here and there under load (issue 42).
        for text in texts:
            assert jsonschema_rs.validator_for(SYMBOL).is_valid(json.loads(text)), text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-gguf", messages=[{"role": "user", "content": "a"}],
                                       max_tokens=8, temperature=0.7, response_format=fmt)
    assert e.value.body["param"] == "response_format" and "temperature 0" in e.value.body["message"]


def test_responses_through_llama_server(client):
    """/v1/responses on a GGUF model: text, streamed and not, and a
    json_schema text.format, greedy, with draft-mtp."""
    import jsonschema_rs

    kw = dict(model="demo-gguf", input="Write a function that adds two numbers.", temperature=0,
              max_output_tokens=24)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and whole.usage.output_tokens == 24 and whole.output_text
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        whole.output_text)
    fmt = {"format": {"type": "json_schema", "name": "s", "schema": SYMBOL, "strict": True}}
    r = client.responses.create(model="demo-gguf", input=PROMPTS[0], temperature=0,
                                max_output_tokens=120, text=fmt)
    assert r.status == "completed"
    assert jsonschema_rs.validator_for(SYMBOL).is_valid(json.loads(r.output_text))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}  # fmt: skip


def test_forced_tool_calls_through_llama_server(gw, client):
    """A forced call (one call, hermes format) on all three APIs: the opening
    tag goes as prompt, the call's JSON as llama-server's json_schema."""
    import anthropic

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="ar-gguf", messages=ask, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"}
    # Several calls need a grammar llama-server cannot take: a clear 400.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ar-gguf", messages=ask, tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_tokens=8)
    assert e.value.body["param"] == "tool_choice" and "parallel_tool_calls" in e.value.body["message"]

    claude = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0)
    msg = claude.messages.create(
        model="ar-gguf", messages=ask, max_tokens=80, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].input == args  # greedy: the same call

    resp = client.responses.create(model="ar-gguf", input=ask[0]["content"], temperature=0,
                                   max_output_tokens=80, parallel_tool_calls=False,
                                   tools=[{"type": "function", **WEATHER["function"]}],
                                   tool_choice="required")
    assert [(o.type, o.name) for o in resp.output] == [("function_call", "get_weather")]
    assert json.loads(resp.output[0].arguments) == args


def test_gguf_without_mtp_refuses_draft_mtp_and_serves_plain(client, ar_gguf):
    report = subprocess.run([sys.executable, "-m", "specgate", "inspect", str(ar_gguf)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "ar-only" in report.stdout
    for asked in ("llamacpp_mtp", "mtp"):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="ar-gguf", prompt="hello", max_tokens=4,
                                      extra_headers={"X-Specgate-Method": asked})
        assert "refused" in e.value.body["message"] and "ar-only" in e.value.body["message"]
    r = client.completions.with_raw_response.create(model="ar-gguf", prompt="hello",
                                                    max_tokens=4, temperature=0)
    assert r.headers["x-specgate-plan"] == "method=none;depth=0;reason=no_drafter;source=rule"
    assert r.parse().usage.completion_tokens == 4


def test_disconnect_aborts_the_upstream_request(client, gw):
    with client.completions.create(model="demo-gguf", prompt="The river was", max_tokens=900,
                                   temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}) as stream:
        for i, _ in enumerate(stream):
            if i == 2:
                break
    pid = llama_servers(gw.process.pid)
    port = _port_of(pid[next(k for k in pid if k.endswith(":mtp") and "demo" in k)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        slots = httpx.get(f"http://127.0.0.1:{port}/slots").json()
        if not any(s["is_processing"] for s in slots):
            break
        time.sleep(0.1)
    assert not any(s["is_processing"] for s in slots), "llama-server still generating"


def _port_of(pid: int) -> int:
    """The port llama-server `pid` listens on (it picked it: --port 0)."""
    (port,) = listening_ports(pid)
    return port


# -- faults: a gateway of its own, since these kill things --------------------------


@pytest.fixture
def fragile(ar_gguf, llama_server_binary, tmp_path):
    g = start_gateway({"llama_server": {"binary": str(llama_server_binary)},
                       "models": gguf_models(ar_gguf)}, tmp_path)
    yield g
    stop_gateway(g)


def test_llama_server_killed_mid_stream(fragile):
    client = openai.OpenAI(base_url=fragile.api, api_key="none", max_retries=0, timeout=60)
    pids = llama_servers(fragile.process.pid)
    mtp = next(pid for k, pid in pids.items() if k.endswith(":mtp"))
    got = []
    started = time.monotonic()
    with pytest.raises(openai.APIError) as e:  # an error event, not a hang or a quiet end
        stream = client.completions.create(model="demo-gguf", prompt="The river was",
                                           max_tokens=900, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                os.kill(mtp, signal.SIGKILL)
    assert time.monotonic() - started < 30
    assert "llama-server" in str(e.value) and "restarted" in str(e.value)
    assert all(c.choices[0].finish_reason is None for c in got)  # never claimed to finish

    # The next request is served by a restarted process.
    r = client.completions.create(model="demo-gguf", prompt="def main():", max_tokens=8,
                                  temperature=0, extra_headers={"X-Specgate-Method": "llamacpp_mtp"})
    assert r.usage.completion_tokens == 8
    again = llama_servers(fragile.process.pid)
    assert mtp not in again.values() and len(again) == len(pids)

    # Non-streaming: a 500 in OpenAI's shape, then service again.
    pids = llama_servers(fragile.process.pid)
    plain = next(pid for k, pid in pids.items() if k.startswith("specgate-demo") and k.endswith(":plain"))
    os.kill(plain, signal.SIGKILL)
    time.sleep(0.05)
    try:
        r = client.completions.create(model="demo-gguf", prompt="def main():", max_tokens=8,
                                      extra_body={"ignore_eos": True},
                                      extra_headers={"X-Specgate-Method": "none"})  # fmt: skip
        assert r.usage.completion_tokens == 8  # the watcher restarted it first: also fine
    except openai.InternalServerError as err:
        assert "llama-server" in err.body["message"]
    # (Sampled at the default temperature: EOS is ignored, or the count could be short.)
    r = client.completions.create(model="demo-gguf", prompt="def main():", max_tokens=8,
                                  extra_body={"ignore_eos": True},
                                  extra_headers={"X-Specgate-Method": "none"})  # fmt: skip
    assert r.usage.completion_tokens == 8


def test_sigterm_leaves_no_llama_server(fragile):
    # demo-gguf plain + mtp, ar-gguf plain (its mtp was refused). On a loaded
    # machine a health check may have just restarted one: wait for it.
    deadline = time.monotonic() + 20
    while len(pids := llama_servers(fragile.process.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids) == 3, pids
    os.killpg(fragile.process.pid, signal.SIGTERM)
    fragile.process.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids.values()):
        time.sleep(0.1)
    left = [p for p in pids.values() if Path(f"/proc/{p}").exists()
            and "llama-server" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    assert not left


def test_sigterm_ends_a_llama_server_stream_with_an_error_event_and_done(
        ar_gguf, llama_server_binary, tmp_path):
    """Past the grace (none here), a stream on llama-server ends as in-process ones do:
    an error event saying the server is shutting down, then [DONE]."""
    g = start_gateway({"server": {"shutdown_grace_s": 0},
                       "llama_server": {"binary": str(llama_server_binary)},
                       "models": gguf_models(ar_gguf)}, tmp_path)  # fmt: skip
    events = []
    try:
        with httpx.stream("POST", g.api + "/completions", timeout=60, json={
                "model": "demo-gguf", "prompt": "The river was", "max_tokens": 900,
                "temperature": 0, "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    os.killpg(g.process.pid, signal.SIGTERM)
        g.process.wait(timeout=30)
    finally:
        stop_gateway(g)
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
