"""The keys file validated at load, SHA-256 keys (old PBKDF2 files still
work), and the limit on wrong keys per client address: a real `specgate
serve` on loopback, the `openai`/`anthropic` SDKs and httpx as clients.

Clients that must count as different addresses connect from 127.0.0.2,
127.0.0.3, ... (all loopback on Linux) through httpx's `local_address`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.gateway.access.auth import FailedAuthLimiter, client_of
from specgate.gateway.access.keys import add_key, read_keys


def cli(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | ({"SPECGATE_HOME": str(home)} if home else {})
    return subprocess.run([sys.executable, "-m", "specgate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


# -- old files ------------------------------------------------------------------------------------


def write_legacy_keys(path: Path, names: list[str]) -> dict[str, str]:
    """A keys file as specgate wrote it before SHA-256 keys (version 1, no
    `scheme`, salted PBKDF2-HMAC-SHA256 at 100k iterations); name -> key."""
    keys, records = {}, []
    for name in names:
        key_id, secret, salt = secrets.token_hex(4), secrets.token_urlsafe(32), secrets.token_bytes(16)
        digest = hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, 100_000)
        records.append({"name": name, "key_id": key_id, "salt": salt.hex(), "hash": digest.hex(),
                        "iterations": 100_000, "models": None, "rpm": None, "tpm": None,
                        "max_concurrent": None, "admin": False, "created": ""})
        keys[name] = f"sg-{key_id}.{secret}"
    path.write_text(json.dumps({"version": 1, "keys": records}, indent=2))
    return keys


def test_bad_record_stops_serve_with_one_line_naming_the_field(tmp_path):
    """A record that would only fail when its key is used (a 500 then) stops
    `specgate serve` at start: exit 2, one line with file, record, field, value."""
    home = tmp_path / "home"
    home.mkdir()
    keys_file = home / "keys"
    write_legacy_keys(keys_file, ["good", "old"])
    data = json.loads(keys_file.read_text())
    for field, value in (("iterations", "many"), ("salt", "not-hex")):
        broken = json.loads(json.dumps(data))
        broken["keys"][1][field] = value
        keys_file.write_text(json.dumps(broken))
        for host in ("127.0.0.1", "0.0.0.0"):  # a LAN bind reads the keys before it binds
            proc = cli("serve", "--host", host, "--port", "0", home=home)
            assert proc.returncode == 2, (host, proc.stderr)
            assert "Traceback" not in proc.stderr
            lines = [line for line in proc.stderr.splitlines() if line.startswith("specgate:")]
            assert len(lines) == 1, proc.stderr
            assert str(keys_file) in lines[0] and "key 'old' (keys[1])" in lines[0]
            assert f"{field}: " in lines[0] and f'"{value}"' in lines[0], lines[0]


# -- a gateway with new and old keys ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hardened(tiny_model, tmp_path_factory):
    """Old PBKDF2 records "old" .. "old-d" (a file from before), then
    "admin" and "alice" added by this specgate."""
    work = tmp_path_factory.mktemp("hardened")
    keys_file = work / "keys"
    keys = write_legacy_keys(keys_file, ["old", "old-b", "old-c", "old-d"])
    keys["admin"] = add_key(keys_file, "admin", admin=True)
    keys["alice"] = add_key(keys_file, "alice")
    gw = start_gateway(
        {"auth": {"keys_file": str(keys_file)},
         "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048}]},
        work,
    )
    gw.keys, gw.keys_file = keys, keys_file
    yield gw
    stop_gateway(gw)


def from_address(address: str, http=httpx):
    """An HTTP client (of `http`: httpx, or httpx2 for the anthropic SDK)
    whose connections come from `address` (a loopback alias)."""
    try:
        with socket.socket() as s:
            s.bind((address, 0))
    except OSError:
        pytest.skip(f"cannot send from {address} on this machine")
    return http.Client(transport=http.HTTPTransport(local_address=address), timeout=60)


def openai_client(gw, key: str, address: str = "127.0.0.1") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.api, api_key=key, max_retries=0,
                         http_client=from_address(address))


def chat(c: openai.OpenAI):
    return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2)


def counter(gw, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(gw.base_url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def reload(gw) -> httpx.Response:
    return httpx.post(gw.base_url + "/admin/reload",
                      headers={"Authorization": f"Bearer {gw.keys['admin']}"})


def test_new_keys_are_sha256_records(hardened):
    records = {r["name"]: r for r in json.loads(hardened.keys_file.read_text())["keys"]}
    for name in ("admin", "alice"):
        secret = hardened.keys[name].split(".", 1)[1]
        assert records[name]["scheme"] == "sha256"
        assert records[name]["hash"] == hashlib.sha256(secret.encode()).hexdigest()
        assert "salt" not in records[name] and "iterations" not in records[name]
    assert chat(openai_client(hardened, hardened.keys["alice"])).usage.completion_tokens >= 1


def test_old_pbkdf2_file_still_authenticates_and_survives_a_write(hardened):
    old = hardened.keys["old"]
    assert chat(openai_client(hardened, old)).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai_client(hardened, old[:-2] + "zz").models.list()  # right id, wrong secret
    before = {r.name: r for r in read_keys(hardened.keys_file)}["old"]
    assert before.scheme == "pbkdf2_sha256"
    # A write (add) cannot turn it into SHA-256 (that needs the secret): it is kept as it is.
    added = cli("keys", "add", "bob", "--keys-file", str(hardened.keys_file))
    assert added.returncode == 0, added.stderr
    data = json.loads(hardened.keys_file.read_text())
    assert data["version"] == 2
    after = {r.name: r for r in read_keys(hardened.keys_file)}
    assert after["old"] == before and after["bob"].scheme == "sha256"
    assert reload(hardened).status_code == 200
    assert chat(openai_client(hardened, old)).usage.completion_tokens >= 1


def test_reload_with_a_bad_file_keeps_the_old_keys(hardened):
    good = hardened.keys_file.read_text()
    data = json.loads(good)
    data["keys"][1]["iterations"] = "many"  # "old-b"
    try:
        hardened.keys_file.write_text(json.dumps(data))
        r = reload(hardened)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_keys_file"
        message = r.json()["error"]["message"]
        assert "old ones stay" in message and "key 'old-b' (keys[1]): iterations" in message
        assert '"many"' in message
        # The old keys stay, "old-b" (the record now broken in the file) too.
        assert chat(openai_client(hardened, hardened.keys["alice"])).usage.completion_tokens >= 1
        assert chat(openai_client(hardened, hardened.keys["old-b"])).usage.completion_tokens >= 1
    finally:
        hardened.keys_file.write_text(good)
    assert reload(hardened).status_code == 200
    assert "Traceback" not in hardened.log()


def test_wrong_keys_from_one_address_get_429_and_are_counted(hardened):
    """Ten wrong keys from 127.0.0.2 are 401s, the eleventh a 429 with
    Retry-After, in each API's shape. From that address, keys that cost one
    hash are still checked and a valid one served (a NAT may share it with
    an attacker), while an old PBKDF2 key not verified yet is refused
    without running its KDF. Other addresses are not affected."""
    invalid = 'specgate_auth_failures_total{reason="invalid"}'
    failures, limited = counter(hardened, invalid), counter(hardened,
                                                           "specgate_auth_rate_limited_total")
    attacker = from_address("127.0.0.2")
    alice, old_c = hardened.keys["alice"], hardened.keys["old-c"]
    wrong = [alice[:-2] + "zz", old_c[:-2] + "zz", "sg-00000000.nope", "sg-nope"]

    def attempt(key: str, path: str = "/chat/completions") -> httpx.Response:
        return attacker.post(hardened.api + path, headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny", "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "hi"}]})

    for i in range(10):
        assert attempt(wrong[i % len(wrong)]).status_code == 401, i
    r = attempt(wrong[0])
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert r.json()["error"]["code"] == "auth_rate_limited"
    with pytest.raises(openai.RateLimitError):
        openai_client(hardened, wrong[2], "127.0.0.2").models.list()
    claude = anthropic.Anthropic(base_url=hardened.base_url, api_key=wrong[1], max_retries=0,
                                 http_client=from_address("127.0.0.2", httpx2))
    with pytest.raises(anthropic.RateLimitError) as err:
        claude.messages.create(model="tiny", max_tokens=1,
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "rate_limit_error"
    assert int(err.value.response.headers["retry-after"]) >= 1
    # A missing key is refused as before (it costs nothing and is not counted).
    assert attacker.get(hardened.api + "/models").status_code == 401

    # The same address with a valid SHA-256 key: served.
    assert chat(openai_client(hardened, alice, "127.0.0.2")).usage.completion_tokens >= 1
    # A valid old PBKDF2 key never verified yet: its slow check is not run.
    with pytest.raises(openai.RateLimitError):
        chat(openai_client(hardened, old_c, "127.0.0.2"))
    # Another address is not limited; once verified there, the key costs one
    # hash and the limited address is served with it too.
    assert chat(openai_client(hardened, old_c, "127.0.0.3")).usage.completion_tokens >= 1
    assert chat(openai_client(hardened, old_c, "127.0.0.2")).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai_client(hardened, wrong[3], "127.0.0.3").models.list()

    assert counter(hardened, invalid) - failures == 11  # ten from .2, one from .3
    assert counter(hardened, "specgate_auth_rate_limited_total") - limited == 4
    assert "wrong API keys from 127.0.0.2" in hardened.log()


def test_a_burst_of_wrong_keys_runs_the_slow_check_at_most_the_limit(hardened):
    """30 wrong secrets at once for an old PBKDF2 key never verified: each
    slow check counts before it runs, so 10 run (401) and 20 never do (429),
    however the requests interleave."""
    wrong = hardened.keys["old-d"][:-2] + "zz"

    async def burst():
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.4", 0))
        except OSError:
            pytest.skip("cannot send from 127.0.0.4 on this machine")
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.4")
        async with httpx.AsyncClient(transport=transport, timeout=120) as h:
            answers = await asyncio.gather(*(
                h.get(hardened.api + "/models", headers={"x-api-key": wrong}) for _ in range(30)))
        return sorted(r.status_code for r in answers)

    assert asyncio.run(burst()) == [401] * 10 + [429] * 20


# -- the limiter's table ------------------------------------------------------------------------


class Clock:
    """A settable clock for the limiter (its constructor takes one)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limiter_memory_is_bounded_and_many_addresses_share_one_allowance():
    clock = Clock()
    limiter = FailedAuthLimiter(limit=3, window_s=60, max_clients=100, clock=clock)
    for _ in range(3):
        limiter.failed("10.0.0.1")
    assert limiter.retry_after("10.0.0.1") == 60
    # Thousands of addresses: the table stays bounded, and the tracked
    # address is not pushed out (it stays limited).
    for i in range(5000):
        limiter.failed(f"10.1.{i // 250}.{i % 250}")
    assert len(limiter) <= 101
    assert limiter.retry_after("10.0.0.1") == 60
    assert limiter.retry_after("10.9.9.9") is not None  # a new one lands in the full overflow
    clock.now += 30
    assert limiter.retry_after("10.0.0.1") == 30
    clock.now += 31  # the window has passed: all forgotten, new addresses tracked again
    assert limiter.retry_after("10.0.0.1") is None
    assert limiter.retry_after("10.9.9.9") is None
    limiter.failed("10.9.9.9")
    assert len(limiter) == 1


def test_client_address_groups_ipv6_by_64():
    def scope(host):
        return {"client": (host, 5000)}

    assert client_of(scope("192.168.1.7")) == "192.168.1.7"
    assert client_of(scope("::ffff:192.168.1.7")) == "192.168.1.7"
    assert client_of(scope("2001:db8:1:2:aaaa::1")) == client_of(scope("2001:db8:1:2:bbbb::9"))
    assert client_of(scope("2001:db8:1:2::1")) == "2001:db8:1:2::/64"
    assert client_of({"client": None}) == "unknown"


def test_the_configured_wrong_key_limit_applies(tiny_model, tmp_path):
    """auth.failed_auth_limit reaches the middleware: 2 allowed, the third is 429."""
    keys_file = tmp_path / "keys"
    key = add_key(keys_file, "alice")
    gw = start_gateway({"auth": {"keys_file": str(keys_file), "failed_auth_limit": 2},
                        "models": [{"id": "tiny", "path": str(tiny_model), "max_context": 2048}]},
                       tmp_path)  # fmt: skip
    try:
        wrong = {"Authorization": f"Bearer {key[:-4]}nope"}
        codes = [httpx.post(gw.api + "/chat/completions", headers=wrong,
                            json={"model": "tiny"}).status_code for _ in range(3)]  # fmt: skip
    finally:
        stop_gateway(gw)
    assert codes == [401, 401, 429]
