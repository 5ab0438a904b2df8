"""API keys, quotas and fair admission against a real gateway on loopback,
with the `openai` and `anthropic` SDKs and raw httpx; the keys CLI and the
refusal of unsafe binds as subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.gateway.access.keys import add_key, read_keys, revoke_key

KEY_SHAPE = re.compile(r"^sg-[0-9a-f]{8}\.[A-Za-z0-9_-]{43}$")


def cli(*args: str, home=None, check=True) -> subprocess.CompletedProcess:
    env = os.environ | ({"SPECGATE_HOME": str(home)} if home else {})
    proc = subprocess.run([sys.executable, "-m", "specgate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


# -- the keys file and CLI ----------------------------------------------------------------------


def test_keys_cli_add_list_revoke(tmp_path):
    home = tmp_path / "home"
    added = cli("keys", "add", "bob", "--models", "tiny,tiny-b", "--rpm", "5", "--tpm", "900",
                "--max-concurrent", "2", home=home)
    key = added.stdout.strip()
    assert KEY_SHAPE.match(key), added.stdout
    assert "only time" in added.stderr and key not in added.stderr
    admin = cli("keys", "add", "root", "--admin", home=home).stdout.strip()

    path = home / "keys"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    for k in (key, admin):
        assert k not in text and k.split(".")[1] not in text  # no plaintext, no secret
    bob, root = read_keys(path)
    assert (bob.name, bob.models, bob.rpm, bob.tpm, bob.max_concurrent, bob.admin) == (
        "bob", ["tiny", "tiny-b"], 5, 900, 2, False)
    assert root.admin and root.models is None
    assert bob.key_id == key[3:11] and bob.created.endswith("+00:00")

    listing = cli("keys", "list", home=home).stdout
    assert "bob" in listing and "root" in listing and "tiny,tiny-b" in listing
    assert key not in listing and key.split(".")[1] not in listing

    cli("keys", "add", "scraper", "--models", "", home=home)  # /metrics only
    assert read_keys(path)[-1].models == []
    assert "(none)" in cli("keys", "list", home=home).stdout
    cli("keys", "revoke", "scraper", home=home)

    dup = cli("keys", "add", "bob", home=home, check=False)
    assert dup.returncode == 2 and "exists" in dup.stderr
    bad = cli("keys", "add", "no spaces", home=home, check=False)
    assert bad.returncode == 2 and "key name" in bad.stderr

    cli("keys", "revoke", "bob", home=home)
    assert [r.name for r in read_keys(path)] == ["root"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    gone = cli("keys", "revoke", "bob", home=home, check=False)
    assert gone.returncode == 1 and "no key named" in gone.stderr


def test_keys_cli_follows_the_config(tmp_path):
    keys_file = tmp_path / "elsewhere" / "team-keys"
    config = tmp_path / "specgate.yaml"
    config.write_text(f"auth:\n  keys_file: {keys_file}\nmodels:\n  - {{id: a, path: p}}\n")
    cli("keys", "add", "carol", "--config", str(config), home=tmp_path / "home")
    assert [r.name for r in read_keys(keys_file)] == ["carol"]
    assert not (tmp_path / "home" / "keys").exists()
    listing = cli("keys", "list", "--keys-file", str(keys_file)).stdout
    assert "carol" in listing


# -- refusing unsafe binds ----------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20"])
def test_serve_refuses_lan_bind_without_keys(tmp_path, host):
    proc = cli("serve", "--host", host, "--port", "1", home=tmp_path / "home", check=False)
    assert proc.returncode == 3, proc.stderr
    assert f"refusing to listen on {host}" in proc.stderr
    assert "specgate keys add NAME" in proc.stderr and "--host 127.0.0.1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_refuses_an_unreadable_keys_file(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "keys").write_text("not json")
    proc = cli("serve", "--host", "0.0.0.0", "--port", "1", home=home, check=False)
    # 2, as for any bad keys file or config (3 is for a bind refused or taken).
    assert proc.returncode == 2 and "not a specgate keys file" in proc.stderr


# -- a gateway with keys ------------------------------------------------------------------------

LIMITS = {
    "admin": {"admin": True},
    "alice": {"models": ["tiny"]},
    "rpm2": {"rpm": 2},
    "conc1": {"max_concurrent": 1},
    "tpm60": {"tpm": 60},
    "flood": {},
    "single": {},
    "doomed": {},
}


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory):
    """One gateway with keys: "tiny" (8 at once), "tiny-b" (another model for
    allow-lists), "fair" (one at a time, a long queue) and "narrow" (one at a
    time, one waiting at most, a short longest wait)."""
    work = tmp_path_factory.mktemp("keyed")
    keys_file = work / "keys"
    keys = {name: add_key(keys_file, name, **limits) for name, limits in LIMITS.items()}
    model = {"path": str(tiny_model), "max_context": 2048}
    gw = start_gateway(
        {
            # No keep-alive before a stream's first token: the fairness test
            # reads a stream's response arriving as its request starting to
            # decode, which a keep-alive would send earlier for a queued one.
            "server": {"log_level": "debug", "stream_keepalive_s": 3600},
            "auth": {"keys_file": str(keys_file), "metrics_requires_key": True},
            "models": [
                {"id": "tiny", **model, "max_concurrent": 8},
                {"id": "tiny-b", **model},
                {"id": "fair", **model, "max_concurrent": 1, "max_queue": 64},
                {"id": "narrow", **model, "max_concurrent": 1, "max_queue": 1,
                 "max_queue_wait_s": 2},
            ],
        },
        work,
    )
    gw.keys = keys
    gw.keys_file = keys_file
    yield gw
    stop_gateway(gw)


def client(gw, name: str | None = None, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.api, api_key=key or gw.keys[name], max_retries=0, timeout=120)


def metrics(gw) -> str:
    r = httpx.get(gw.base_url + "/metrics", headers={"Authorization": f"Bearer {gw.keys['admin']}"})
    assert r.status_code == 200
    return r.text


def gauge(gw, name: str, model: str) -> float:
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', metrics(gw), re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(predicate, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def chat(c: openai.OpenAI, model: str = "tiny", max_tokens: int = 4, **kw):
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=max_tokens, **kw)


def long_stream(gw, name: str, model: str):
    """A streaming request that decodes for a while; iterate it to hold it open."""
    return httpx.stream(
        "POST", gw.api + "/chat/completions", timeout=120,
        headers={"Authorization": f"Bearer {gw.keys[name]}"},
        json={"model": model, "messages": [{"role": "user", "content": "count"}],
              "max_tokens": 1900, "temperature": 0, "stream": True, "ignore_eos": True},
    )


def test_missing_or_wrong_key_is_401_in_each_apis_shape(keyed):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "sg-00000000.nope"},
                    {"Authorization": "Basic " + keyed.keys["alice"]}):
        r = httpx.post(keyed.api + "/chat/completions", headers=headers, json={"model": "tiny"})
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    # A real key with one character changed: right id, wrong secret.
    key = keyed.keys["alice"]
    forged = key[:-1] + ("A" if key[-1] != "A" else "B")
    with pytest.raises(openai.AuthenticationError):
        chat(client(keyed, key=forged))
    with pytest.raises(openai.AuthenticationError):
        client(keyed, key="sg-wrong").models.list()
    r = httpx.post(keyed.api + "/messages", json={"model": "tiny"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": r.json()["error"]["message"]}}
    # Open: liveness, readiness. Behind a key (configured): metrics.
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    assert httpx.get(keyed.base_url + "/ready").status_code == 200
    assert httpx.get(keyed.base_url + "/metrics").status_code == 401
    assert httpx.get(keyed.base_url + "/metrics",
                     headers={"x-api-key": keyed.keys["alice"]}).status_code == 200


def test_valid_key_with_bearer_and_x_api_key(keyed):
    out = chat(client(keyed, "alice"), temperature=0)
    assert out.usage.completion_tokens >= 1
    r = httpx.post(keyed.api + "/completions", headers={"x-api-key": keyed.keys["alice"]},
                   json={"model": "tiny", "prompt": "def f():", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_anthropic_sdk_sends_x_api_key(keyed):
    probe = httpx.post(keyed.api + "/messages", headers={"x-api-key": keyed.keys["alice"]},
                       json={})
    if probe.status_code == 404:
        pytest.skip("no /v1/messages route in this checkout")
    c = anthropic.Anthropic(base_url=keyed.base_url, api_key=keyed.keys["alice"], max_retries=0)
    msg = c.messages.create(model="tiny", max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert msg.usage.output_tokens >= 1
    with pytest.raises(anthropic.PermissionDeniedError):
        c.messages.create(model="tiny-b", max_tokens=4,
                          messages=[{"role": "user", "content": "hi"}])
    bad = anthropic.Anthropic(base_url=keyed.base_url, api_key="sg-x.y", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="tiny", max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])


def test_model_allow_list(keyed):
    alice = client(keyed, "alice")
    assert [m.id for m in alice.models.list().data] == ["tiny"]
    assert [m.id for m in client(keyed, "admin").models.list().data] == [
        "tiny", "tiny-b", "fair", "narrow"]
    with pytest.raises(openai.PermissionDeniedError) as err:
        chat(alice, model="tiny-b")
    assert err.value.body["code"] == "model_not_allowed" and "tiny-b" in err.value.message
    # A model that does not exist at all: the same answer, so a key cannot probe.
    with pytest.raises(openai.PermissionDeniedError):
        chat(alice, model="secret-model")
    with pytest.raises(openai.NotFoundError):
        chat(client(keyed, "admin"), model="secret-model")


def test_rpm_limit_429_with_retry_after(keyed):
    c = client(keyed, "rpm2")
    chat(c)
    chat(c)
    with pytest.raises(openai.RateLimitError) as err:
        chat(c)
    retry = int(err.value.response.headers["retry-after"])
    assert 1 <= retry <= 60
    assert err.value.body["code"] == "rate_limit_exceeded"
    assert "requests per minute" in err.value.message
    # Other keys are not affected.
    chat(client(keyed, "alice"))


def test_concurrency_limit_429(keyed):
    with long_stream(keyed, "conc1", "tiny") as resp:
        lines = resp.iter_lines()
        next(lines)
        with pytest.raises(openai.RateLimitError) as err:
            chat(client(keyed, "conc1"))
        assert err.value.response.headers["retry-after"] == "1"
        assert "in flight" in err.value.message
    # The slot comes back when the stream ends.
    wait_for(lambda: _ok(lambda: chat(client(keyed, "conc1"))), what="conc1's stream to end")


def _ok(call) -> bool:
    try:
        call()
        return True
    except openai.RateLimitError:
        return False


def test_tpm_limit_counts_prompt_and_completion(keyed):
    c = client(keyed, "tpm60")
    first = c.completions.create(model="tiny", prompt="def f():", max_tokens=60, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert first.usage.total_tokens > 60  # admitted with room, counted past the limit
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert "tokens per minute" in err.value.message
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 61


def test_revoked_key_is_refused_after_reload(keyed):
    doomed = client(keyed, "doomed")
    chat(doomed)
    assert revoke_key(keyed.keys_file, "doomed")
    chat(doomed)  # the server has not re-read the file yet
    r = httpx.post(keyed.base_url + "/admin/reload",
                   headers={"Authorization": f"Bearer {keyed.keys['alice']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    r = httpx.post(keyed.base_url + "/admin/reload",
                   headers={"Authorization": f"Bearer {keyed.keys['admin']}"})
    assert r.status_code == 200 and "doomed" not in r.json()["names"]
    with pytest.raises(openai.AuthenticationError):
        chat(doomed)
    chat(client(keyed, "alice"))  # the others stay


def test_admin_unloads_and_loads_a_model(keyed):
    admin = {"Authorization": f"Bearer {keyed.keys['admin']}"}
    r = httpx.post(keyed.base_url + "/admin/models/tiny-b/unload",
                   headers={"Authorization": f"Bearer {keyed.keys['alice']}"})
    assert r.status_code == 403
    r = httpx.post(keyed.base_url + "/admin/models/tiny-b/unload", headers=admin, timeout=60)
    assert r.json() == {"id": "tiny-b", "status": "unloaded"}
    assert httpx.get(keyed.base_url + "/ready", headers=admin).json()["models"]["tiny-b"] == "unloaded"
    r = httpx.post(keyed.base_url + "/admin/models/tiny-b/load", headers=admin, timeout=120)
    assert r.json() == {"id": "tiny-b", "status": "ready"}
    assert chat(client(keyed, "admin"), model="tiny-b").usage.completion_tokens >= 1
    # Unloaded again: the next request loads it by itself.
    httpx.post(keyed.base_url + "/admin/models/tiny-b/unload", headers=admin, timeout=60)
    assert chat(client(keyed, "admin"), model="tiny-b").usage.completion_tokens >= 1
    assert httpx.get(keyed.base_url + "/ready", headers=admin).json()["models"]["tiny-b"] == "ready"
    r = httpx.post(keyed.base_url + "/admin/models/nope/unload", headers=admin)
    assert r.status_code == 404


def test_queue_bound_timeout_and_disconnect(keyed):
    """narrow: 1 decoding, 1 waiting at most, 2 s longest wait."""
    admin = client(keyed, "admin")
    with long_stream(keyed, "flood", "narrow") as resp:
        lines = resp.iter_lines()
        next(lines)
        # A waiter that leaves: the queue forgets it.
        async def leave():
            async with httpx.AsyncClient(timeout=60) as h:
                task = asyncio.create_task(h.post(
                    keyed.api + "/chat/completions", headers={"x-api-key": keyed.keys["single"]},
                    json={"model": "narrow", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4}))
                await asyncio.to_thread(wait_for, lambda: gauge(
                    keyed, "specgate_num_requests_waiting", "narrow") == 1)
                task.cancel()
        asyncio.run(leave())
        wait_for(lambda: gauge(keyed, "specgate_num_requests_waiting", "narrow") == 0,
                 what="the disconnected waiter to leave the queue")
        # One waits (and times out after 2 s); the next finds the queue full.
        outcome = {}

        def queued():
            try:
                chat(client(keyed, "single"), model="narrow")
            except openai.APIStatusError as e:
                outcome["error"] = e

        waiter = threading.Thread(target=queued)
        waiter.start()
        wait_for(lambda: gauge(keyed, "specgate_num_requests_waiting", "narrow") == 1)
        with pytest.raises(openai.RateLimitError) as err:
            chat(admin, model="narrow")
        assert err.value.body["code"] == "overloaded"
        assert int(err.value.response.headers["retry-after"]) >= 1
        waiter.join(timeout=30)
        e = outcome["error"]
        assert e.status_code == 503 and e.body["code"] == "queue_timeout"
        assert int(e.response.headers["retry-after"]) >= 1
    text = metrics(keyed)
    assert re.search(r'specgate_key_rejected_requests_total\{key="admin",reason="queue_full"\} 1',
                     text)
    assert re.search(r'specgate_key_rejected_requests_total\{key="single",'
                     r'reason="queue_timeout"\} 1', text)


# -- fairness ----------------------------------------------------------------------------------

FLOOD = 30
# Long enough that the flood queues however slowly this test's client sends
# it beside other tests: at 128 tokens (0.3 s of decoding each) a loaded
# client sent the next request only as the last was done, and no queue
# built (ci24). Only the requests ahead of the single key's are decoded.
FLOOD_TOKENS = 1024


def test_one_keys_flood_does_not_delay_another_key(keyed):
    """On "fair" (one request decoding at a time), key `flood` queues 30
    streaming requests; key `single` then sends one. Measured in admissions:
    how many flood requests start decoding after `single` has sent its
    request and before it starts. Round-robin admission bounds that at 1
    (the queue serves one flood request, then `single`), plus 1 for a flood
    request admitted while `single`'s request was still on the wire: at
    most 2, i.e. `single` waits at most 3 x FLOOD_TOKENS decode steps (the
    running request and two more) instead of 30 x FLOOD_TOKENS behind a FIFO."""
    starts: dict[str, float] = {}

    async def one(c: openai.AsyncOpenAI, tag: str, sent: dict | None = None):
        if sent is not None:
            sent["at"] = time.monotonic()
        # The gateway answers a stream once its first token exists, so the
        # response arriving is the request having started decoding.
        stream = await c.completions.create(
            model="fair", prompt=f"def {tag}():", max_tokens=FLOOD_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        starts[tag] = time.monotonic()
        async for _ in stream:
            pass

    async def main():
        flood = openai.AsyncOpenAI(base_url=keyed.api, api_key=keyed.keys["flood"],
                                   max_retries=0, timeout=600)
        single = openai.AsyncOpenAI(base_url=keyed.api, api_key=keyed.keys["single"],
                                    max_retries=0, timeout=600)
        await flood.models.list()  # each key checked once (the slow KDF) before the flood
        await single.models.list()
        tasks = [asyncio.create_task(one(flood, f"a{i}")) for i in range(FLOOD)]
        await asyncio.to_thread(wait_for, lambda: gauge(
            keyed, "specgate_num_requests_waiting", "fair") >= FLOOD - 8, 60, "the flood to queue")
        sent: dict = {}
        await one(single, "b", sent)
        ahead = sorted(t for tag, t in starts.items() if tag != "b" and sent["at"] < t < starts["b"])
        waiting_after = gauge(keyed, "specgate_num_requests_waiting", "fair")
        # What is measured is measured: the flood's clients leave (decoding
        # the rest, one at a time, took most of this test's time), and the
        # queue and the slot are seen to empty before the next test.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(wait_for, lambda: gauge(
            keyed, "specgate_num_requests_waiting", "fair") == 0 and gauge(
            keyed, "specgate_num_requests_running", "fair") == 0, 60, "the flood to leave")
        return len(ahead), waiting_after

    ahead, waiting_after = asyncio.run(main())
    print(f"fairness: {ahead} flood requests started after the single key's request was sent "
          f"and before it started; {waiting_after:.0f} flood requests still waiting then")
    assert ahead <= 2
    assert waiting_after >= FLOOD - 10  # it really jumped the flood


# -- what the logs and metrics hold -----------------------------------------------------------


def test_key_names_in_metrics_no_secrets_anywhere(keyed):
    chat(client(keyed, "alice"))
    text = metrics(keyed)
    assert re.search(r'specgate_key_requests_total\{key="alice",status="ok"\} \d', text)
    assert re.search(r'specgate_key_generation_tokens_total\{key="alice"\} \d', text)
    assert re.search(r'specgate_key_prompt_tokens_total\{key="alice"\} \d', text)
    assert re.search(r'specgate_key_rejected_requests_total\{key="rpm2",reason="rpm"\} 1', text)
    assert 'specgate_auth_failures_total{reason="invalid"}' in text
    log = keyed.log()
    assert "API keys from" in log  # the server did log at debug level meanwhile
    for key in keyed.keys.values():
        secret = key.split(".", 1)[1]
        assert key not in text and secret not in text
        assert key not in log and secret not in log


# -- an open server --------------------------------------------------------------------------


def test_open_loopback_server_when_no_keys(gateway):
    """The session gateway has no keys: anything goes, as one anonymous key."""
    r = httpx.post(gateway.api + "/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    text = httpx.get(gateway.base_url + "/metrics").text
    assert re.search(r'specgate_key_requests_total\{key="anonymous",status="ok"\}', text)


def test_no_keys_left_on_a_lan_bind_serves_nobody(tiny_model, tmp_path):
    """Revoking the last key of a server listening beyond loopback must not
    open it: with no keys it answers 401 to everyone."""
    keys_file = tmp_path / "keys"
    admin = add_key(keys_file, "admin", admin=True)
    from specgate.gateway.access.auth import KeyStore

    store = KeyStore(keys_file, open_when_empty=False)
    revoke_key(keys_file, "admin")
    store.reload()
    assert store.empty

    async def call():
        from specgate.gateway.app import create_app
        from specgate.gateway.config import parse_config

        config = parse_config({"server": {"host": "0.0.0.0"},
                               "auth": {"keys_file": str(keys_file)},
                               "models": [{"id": "tiny", "path": str(tiny_model)}]})
        app = create_app(config)  # not started: no lifespan, no model loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
            r = await h.get("/v1/models", headers={"Authorization": f"Bearer {admin}"})
            health = await h.get("/health")
        return r, health

    r, health = asyncio.run(call())
    assert r.status_code == 401 and "no API keys" in r.json()["error"]["message"]
    assert health.status_code == 200
    assert json.loads(keys_file.read_text())["keys"] == []


def test_ready_shows_model_details_to_admin_keys_only(keyed):
    """/ready is open to probes, but model ids and load errors (file paths)
    are for admins: a key restricted to some models must not learn the rest."""
    bare = httpx.get(keyed.base_url + "/ready")
    assert bare.status_code == 200 and bare.json() == {"status": "ready"}
    alice = httpx.get(keyed.base_url + "/ready",
                      headers={"Authorization": f"Bearer {keyed.keys['alice']}"})
    assert alice.json() == {"status": "ready"}
    admin = httpx.get(keyed.base_url + "/ready",
                      headers={"Authorization": f"Bearer {keyed.keys['admin']}"})
    assert set(admin.json()["models"]) == {"tiny", "tiny-b", "fair", "narrow"}
