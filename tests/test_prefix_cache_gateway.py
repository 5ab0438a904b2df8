"""The prefix cache through a real gateway, with the openai and anthropic SDKs.

The shipped demo is a hybrid model (GatedDeltaNet layers): its state can be
reused only from snapshots, which the engines keep at the system prompt's
end, at the end of the conversation before the newest message, and before
a prompt's last token. Every answer is checked against "cold", the same
checkpoint copied to another directory (its own weights, engines and cache)
with the prefix cache off, decoding plainly.
"""

from __future__ import annotations

import re
import shutil

import anthropic
import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway

from specgate.builders.drafters import build_dspark_drafter
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.gateway.access.keys import add_key

SYSTEM = (
    "You are a careful Python reviewer for a team that writes network services. "
    "Read the code you are given, point out bugs first, then style, and answer in short "
    "paragraphs. Prefer the standard library; never suggest a dependency for what asyncio, "
    "socket, json or logging already do. When you show code, show a whole function. "
) * 4
QUESTIONS = ["def read_config(path):\n", "class Pool:\n    def __init__(self):\n",
             "async def fetch(url):\n"]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-gateway")
    cold = shutil.copytree(default_model_path(), root / "demo-copy")
    dspark = build_dspark_drafter(root / "dspark", target=default_model_path(), block_size=4,
                                  num_hidden_layers=1)  # fmt: skip
    keys_file = root / "keys"
    keys = {name: add_key(keys_file, name) for name in ("alice", "bob")}
    demo = {"path": "builtin:demo", "mtp_depth": 3}
    gw = start_gateway({
        "auth": {"keys_file": str(keys_file)},
        "prefix_cache": {"disk_bytes": 0},
        "models": [
            demo | {"id": "demo", "engines": ["mlx_plain", "mlx_mtp", "mlx_dflash"],
                    "drafter": "builtin:demo-dflash"},
            demo | {"id": "demo-dspark", "engines": ["mlx_plain", "mlx_dspark"],
                    "drafter": str(dspark)},
            {"id": "cold", "path": str(cold), "prefix_cache_size": 0},
        ],
    }, root)  # fmt: skip
    yield gw, keys
    stop_gateway(gw)


def client(served, key="alice") -> openai.OpenAI:
    gw, keys = served
    return openai.OpenAI(base_url=gw.api, api_key=keys[key], max_retries=0)


def chat(c: openai.OpenAI, model: str, messages: list[dict], method: str, max_tokens=40):
    return c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                     temperature=0, extra_headers={"X-Specgate-Method": method})  # fmt: skip


def reference(c: openai.OpenAI, messages: list[dict], max_tokens=40):
    return chat(c, "cold", messages, "none", max_tokens)


def same_answer(got, want) -> None:
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert want.usage.prompt_tokens_details.cached_tokens == 0  # cold is cold


@pytest.mark.parametrize("model,method", [  # the block drafters' in the proof tier (~45 s)
    ("demo", "mtp"), pytest.param("demo", "dflash", marks=pytest.mark.proof),
    pytest.param("demo-dspark", "dspark", marks=pytest.mark.proof)])  # fmt: skip
def test_same_system_prompt_other_questions_full_answers(served, model, method):
    """mlx-lm issue 1292's case (a second request with the same system prompt
    came back with 1-72 tokens instead of 400, MTP on): every answer has its
    full length and is the cold plain answer, while the system prompt after
    the first comes from the cache (shared snapshot, drafter state included)."""
    c = client(served)
    system = f"[{model} {method}] " + SYSTEM  # this test's own prefix
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        got = chat(c, model, messages, method)
        same_answer(got, reference(c, messages))
        cached = got.usage.prompt_tokens_details.cached_tokens
        if i == 0:
            assert cached == 0
            system_tokens = None
        else:
            assert cached > 100  # the system prompt's snapshot
            system_tokens = system_tokens or cached
            assert cached == system_tokens  # and exactly it: the questions differ after it


def test_turn_two_resumes_after_turn_one(served):
    c = client(served)
    system = "[turns] " + SYSTEM
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "def parse(line):\n"}]  # fmt: skip
    first = chat(c, "demo", turn1, "mtp")
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now the tests for it."}]  # fmt: skip
    second = chat(c, "demo", turn2, "mtp")
    same_answer(second, reference(c, turn2))
    # Everything turn 1 saw is reused: only the reply and the new message are prefilled.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    # An identical retry prefills one token.
    again = chat(c, "demo", turn2, "none")
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == second.choices[0].message.content


def test_keys_share_a_system_prompt_and_nothing_more(served):
    alice, bob = client(served, "alice"), client(served, "bob")
    system = "[keys] " + SYSTEM
    secret = [{"role": "system", "content": system},
              {"role": "user", "content": "The launch code is 4471; def check(code):\n"}]  # fmt: skip
    first = chat(alice, "demo", secret, "none", max_tokens=4)
    assert alice.chat.completions.create(model="demo", messages=secret, max_tokens=4,
                                         temperature=0).usage.prompt_tokens_details.cached_tokens \
        == first.usage.prompt_tokens - 1  # fmt: skip
    # Bob sends alice's very prompt: he gets the system prompt's state and no more.
    probe = chat(bob, "demo", secret, "none", max_tokens=4)
    cached = probe.usage.prompt_tokens_details.cached_tokens
    assert 100 < cached < probe.usage.prompt_tokens - 10


def test_anthropic_usage_counts_cache_reads(served):
    gw, keys = served
    c = anthropic.Anthropic(base_url=gw.base_url, api_key=keys["alice"], max_retries=0)
    system = "[anthropic] " + SYSTEM
    kwargs = dict(model="demo", max_tokens=8, system=system)
    c.messages.create(messages=[{"role": "user", "content": "def a():\n"}], **kwargs)
    count = c.messages.count_tokens(model="demo", system=system,
                                    messages=[{"role": "user", "content": "def b():\n"}])  # fmt: skip
    reply = c.messages.create(messages=[{"role": "user", "content": "def b():\n"}], **kwargs)
    u = reply.usage
    assert u.cache_read_input_tokens > 100 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == count.input_tokens
    with c.messages.stream(messages=[{"role": "user", "content": "def c():\n"}], **kwargs) as s:
        start = None
        for event in s:
            if event.type == "message_start":
                start = event.message.usage
    assert start.cache_read_input_tokens == u.cache_read_input_tokens


def test_metrics_count_hits(served):
    gw, keys = served
    c = client(served)
    messages = [{"role": "system", "content": "[metrics] " + SYSTEM},
                {"role": "user", "content": "x = 1\n"}]  # fmt: skip
    chat(c, "demo", messages, "none", max_tokens=2)
    chat(c, "demo", messages, "none", max_tokens=2)
    # httpx's 5 s default is shorter than a CPU wait on a loaded CI machine:
    # ci17's gateway logged "held up for 5.8 s, 5.8 s of it waiting for a CPU
    # (load 11.8)" at this GET, which then timed out. Bounded, not a timing.
    text = httpx.get(gw.base_url + "/metrics", timeout=60).text

    def value(name, **labels):
        sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        m = re.search(rf"^{name}\{{{sel}\}} (\S+)$", text, re.M)
        assert m, f"{name}{{{sel}}} missing"
        return float(m.group(1))

    assert value("specgate_prefix_cache_hits_total", model="demo", tier="ram") >= 1
    assert value("specgate_prefix_cache_hit_tokens_total", model="demo", tier="ram") > 100
    assert value("specgate_prefix_cache_bytes", model="demo", tier="ram") > 0
    assert value("specgate_prefix_cache_lookups_total", model="demo") >= 2
    assert value("specgate_prefix_cache_lookups_total", model="cold") == 0  # size 0: off


# -- across restarts ---------------------------------------------------------------------


def test_a_restart_reloads_the_disk_tier_and_refuses_a_corrupt_entry(tmp_path):
    home = tmp_path / "home"
    config = {"prefix_cache": {"disk_min_tokens": 16, "ram_bytes": "2MiB"},
              "models": [{"id": "demo", "path": "builtin:demo"}]}  # fmt: skip
    prompt = "import json\nimport os\n\n\ndef load_settings(path, defaults=None):\n"

    def complete(gw, text=prompt, max_tokens=24):
        c = openai.OpenAI(base_url=gw.api, api_key="x", max_retries=0)
        return c.completions.create(model="demo", prompt=text, max_tokens=max_tokens,
                                    temperature=0)  # fmt: skip

    gw = start_gateway(config, tmp_path, home=home)
    try:
        first = complete(gw)
        # Other long prompts (their entries are made by the prefill: one
        # token each is enough): the RAM budget (2 MiB for every model) holds.
        # (The demo's entries for them are ~0.7 MiB: the first already evicts,
        # three evict 5 entries.)
        for i in range(3):
            complete(gw, f"# file {i}\n" + prompt * 6, max_tokens=1)
        metrics = httpx.get(gw.base_url + "/metrics").text
        ram = float(re.search(r'^specgate_prefix_cache_bytes\{model="demo",tier="ram"\} (\S+)$',
                              metrics, re.M).group(1))  # fmt: skip
        assert 0 < ram <= 2 << 20
        evicted = re.search(r'^specgate_prefix_cache_evictions_total\{model="demo",tier="ram"\} (\S+)$',
                            metrics, re.M)  # fmt: skip
        assert evicted and float(evicted.group(1)) > 0  # the prompts offered more than it holds
    finally:
        stop_gateway(gw)  # SIGTERM: queued disk writes are flushed
    files = list((home / "prefix-cache").glob("*/*.safetensors"))
    assert files

    gw = start_gateway(config, tmp_path, home=home)
    try:
        again = complete(gw)
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        metrics = httpx.get(gw.base_url + "/metrics").text
        assert re.search(r'^specgate_prefix_cache_hits_total\{model="demo",tier="disk"\} 1\.0$',
                         metrics, re.M)  # fmt: skip
    finally:
        stop_gateway(gw)

    for f in (home / "prefix-cache").glob("*/*.safetensors"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    gw = start_gateway(config, tmp_path, home=home)
    try:
        third = complete(gw)
        assert third.choices[0].text == first.choices[0].text
        assert third.usage.prompt_tokens_details.cached_tokens == 0
        assert "refused" in gw.log() and "do not match its hash" in gw.log()
        metrics = httpx.get(gw.base_url + "/metrics").text
        refused = re.search(r'^specgate_prefix_cache_refused_total\{model="demo"\} (\S+)$',
                            metrics, re.M)  # fmt: skip
        assert refused and float(refused.group(1)) >= 1
    finally:
        stop_gateway(gw)
