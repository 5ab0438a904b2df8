"""The admin page in a real headless browser (Debian's chromium, driven by
playwright; .ci/run installs chromium, and nothing downloads a browser):
loaded from live gateways, its script fills the tables from /admin/status,
and its buttons act. An admin unloads and loads a model and sees its state
change; a key that is not an admin's sees only its own usage and gets 403
for every action; the queue view shows who waits for a model's only slot
while another key's stream holds it. A screenshot goes to
bench/results/admin-page.png for the notes. The data endpoint is checked
for its shape and for what each caller may see."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import time

import httpx
import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.gateway.access.keys import add_key

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = REPO / "bench" / "results" / "admin-page.png"
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="no chromium (Debian: apt-get install chromium)")


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """An open loopback server (no keys): everyone is the admin."""
    gw = start_gateway({"models": [
        {"id": "tiny", "path": str(tiny_model), "max_context": 2048},
        {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"]},
        {"id": "later", "path": str(tiny_model), "load": "on_demand"},
    ]}, tmp_path_factory.mktemp("admin-open"))  # fmt: skip
    c = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    for model in ("tiny", "demo"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "def f(x):"}],
                                  max_tokens=24, temperature=0)  # fmt: skip
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory):
    """A server with keys, and one model that decodes one request at a time."""
    work = tmp_path_factory.mktemp("admin-keyed")
    keys_file = work / "keys"
    keys = {"user": add_key(keys_file, "user", rpm=100), "other": add_key(keys_file, "other"),
            "ops": add_key(keys_file, "ops", admin=True)}  # fmt: skip
    gw = start_gateway({"auth": {"keys_file": str(keys_file)}, "models": [
        {"id": "one", "path": str(tiny_model), "max_context": 2048, "max_concurrent": 1},
    ]}, work)  # fmt: skip
    gw.keys = keys
    yield gw
    stop_gateway(gw)


def auth(gw, name: str) -> dict:
    return {"Authorization": f"Bearer {gw.keys[name]}"}


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])  # fmt: skip
        yield b
        b.close()


def open_page(browser, url: str, key: str | None = None):
    """The admin page with `key` already typed in (in localStorage)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1400})
    if key is not None:
        context.add_init_script(f"localStorage.setItem('specgate-key', {json.dumps(key)})")
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(url + "/")
    return page


def cells(page, table: str) -> dict[str, list[str]]:
    """A table's body rows by their first cell's text."""
    rows = page.eval_on_selector_all(
        f"#{table} tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.innerText.trim()))")
    return {row[0]: row for row in rows}


def test_the_status_data_says_what_the_page_shows(served):
    s = httpx.get(served.base_url + "/admin/status").json()
    assert s["view"] == "admin"
    states = {m["id"]: m["state"] for m in s["models"]}
    assert states == {"tiny": "ready", "demo": "ready", "later": "unloaded"}
    assert {p["method"] for p in s["plans"]["demo"]} <= {"mtp", "none"} and s["plans"]["tiny"]
    assert s["keys"]["anonymous"]["requests"]["ok"] == 2
    assert [k["name"] for k in s["key_list"]] == ["anonymous"]
    assert s["requests"] == []  # nothing decoding now
    assert {q["model"]: q["waiting"] for q in s["queues"]} == {"tiny": [], "demo": [], "later": []}
    # the access log's last requests, the page's own reads left out
    assert [(e["model"], e["outcome"]) for e in s["recent"]] == [("tiny", "ok"), ("demo", "ok")]
    point = s["history"]["points"][0]  # sampled as the server started
    assert point["rss"] > 0 and set(point) == {"time", "tokens_per_s", "rss", "models"}


def test_residency_changes_while_serving(served):
    url = served.base_url + "/admin/models/later"
    m = httpx.post(url + "/pin").json()
    assert m["pin"] is True and m["configured"] == {"pin": False}
    m = httpx.post(url + "/idle_ttl", json={"idle_ttl_s": 600}).json()
    assert m["idle_ttl_s"] == 600 and m["configured"] == {"pin": False, "idle_ttl_s": None}
    for bad in ({"idle_ttl_s": 0}, {"idle_ttl_s": "10"}, {"idle_ttl_s": True}, {}, [600]):
        r = httpx.post(url + "/idle_ttl", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "idle_ttl_s", bad
    assert httpx.post(url + "/idle_ttl", content=b"{").status_code == 400
    m = httpx.post(url + "/unpin").json()
    m = httpx.post(url + "/idle_ttl", json={"idle_ttl_s": None}).json()
    assert (m["pin"], m["idle_ttl_s"], m["configured"]) == (False, None, {})
    assert httpx.post(served.base_url + "/admin/models/nope/pin").status_code == 404


@needs_chromium
def test_the_page_shows_the_server_and_an_admin_unloads_and_loads(served, browser):
    page = open_page(browser, served.base_url)
    page.wait_for_selector('#models tr[data-key="demo"]')
    models = cells(page, "models")
    assert set(models) == {"tiny", "demo", "later"}
    assert models["demo"][1] == "ready" and models["later"][1] == "unloaded"
    # the memory column: its total, then weights and KV apart
    assert re.match(r"[\d.]+ GiB \(weights [\d.]+ GiB, KV [\d.]+ GiB\)$", models["demo"][2]), models
    assert "mlx_mtp" in models["demo"][3]
    assert models["tiny"][4] == "0 of 8 decoding, 0 waiting"
    assert "on_demand" in models["later"][6]
    plans = {(row[0], row[1]) for row in page.eval_on_selector_all(
        "#plans tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.innerText))")}
    assert ("tiny", "none") in plans
    assert "ok 2" in cells(page, "keys")["anonymous"][4]
    assert page.inner_text("#requests tbody") == "none"
    recent = page.inner_text("#recent")
    assert "/v1/chat/completions" in recent and "/admin/status" not in recent
    assert "3 models" in page.inner_text("#summary")
    assert page.inner_text("#viewing") == "admin view"
    assert page.locator("#chart-mem polyline").count() == 2
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000

    state = page.locator('#models tr[data-key="tiny"] td.state')
    page.click('#models tr[data-key="tiny"] button[data-action="unload"]')
    state.filter(has_text=re.compile("^unloaded$")).wait_for()
    assert "unload tiny: done" in page.inner_text("#notice")
    page.click('#models tr[data-key="tiny"] button[data-action="load"]')
    state.filter(has_text=re.compile("^ready$")).wait_for()

    # pin from the page: the row says so, and that the file says otherwise
    page.click('#models tr[data-key="tiny"] button[data-action="pin"]')
    residency = page.locator('#models tr[data-key="tiny"] td.residency')
    residency.filter(has_text="the config says pin False").wait_for()
    page.click('#models tr[data-key="tiny"] button[data-action="unpin"]')
    residency.filter(has_text=re.compile("stays loaded$")).wait_for()

    page.click("#reload")
    page.locator("#reload-result").filter(has_text="unchanged: tiny, demo, later").wait_for()
    # a bad file: the refusal and its reason, and nothing changed
    good = served.config_path.read_text()
    served.config_path.write_text(good.replace("max_context: 2048", "max_context: -1"))
    try:
        page.click("#reload")
        refused = page.locator("#reload-result").filter(has_text="HTTP 400")
        refused.wait_for()
        assert "config not reloaded" in refused.inner_text() and "max_context" in refused.inner_text()
    finally:
        served.config_path.write_text(good)
    page.context.close()


def test_who_sees_what(keyed):
    base = keyed.base_url
    # A loopback client with no key: the status, read-only.
    s = httpx.get(base + "/admin/status").json()
    assert s["view"] == "read_only" and s["models"][0]["id"] == "one"
    assert "keys" not in s and "key_list" not in s and "errors" not in s
    # A key that is not an admin's: its own usage only.
    c = openai.OpenAI(base_url=keyed.api, api_key=keyed.keys["user"], max_retries=0)
    c.chat.completions.create(model="one", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    s = httpx.get(base + "/admin/status", headers=auth(keyed, "user")).json()
    assert s["view"] == "own_key" and set(s) == {"view", "key", "waiting", "recent"}
    assert s["key"]["name"] == "user" and s["key"]["requests"] == {"ok": 1}
    assert s["key"]["limits"]["rpm"] == 100 and s["key"]["last_minute"]["requests"] == 1
    assert [(e["key"], e["path"]) for e in s["recent"]] == [("user", "/v1/chat/completions")]
    # The admin sees every key, never a secret, hash or id.
    s = httpx.get(base + "/admin/status", headers=auth(keyed, "ops")).json()
    assert s["view"] == "admin" and [k["name"] for k in s["key_list"]] == ["user", "other", "ops"]
    text = json.dumps(s["key_list"])
    assert all(k.split(".")[0].removeprefix("sg-") not in text for k in keyed.keys.values())
    assert "hash" not in text
    # Every action: 403 for a key that is not an admin's, 401 without a key.
    for path in ("/admin/reload", "/admin/models/one/unload", "/admin/models/one/load",
                 "/admin/models/one/pin", "/admin/models/one/unpin", "/admin/models/one/idle_ttl"):
        r = httpx.post(base + path, headers=auth(keyed, "user"), json={"idle_ttl_s": 5})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", path
        assert httpx.post(base + path, json={"idle_ttl_s": 5}).status_code == 401, path
    assert httpx.get(base + "/admin/models").status_code == 401


@needs_chromium
def test_the_page_for_a_key_that_is_not_an_admins(keyed, browser):
    page = open_page(browser, keyed.base_url, keyed.keys["user"])
    page.locator("#viewing").filter(has_text="your key's view").wait_for()
    assert cells(page, "own")["user"][2] == "rpm 100"
    assert page.locator("#models").is_hidden() and page.locator("#keys").is_hidden()
    # The page's own action, as its buttons call it: the server's 403, shown.
    page.evaluate("act('unload one', '/admin/models/one/unload')")
    page.locator("#notice").filter(has_text="HTTP 403").wait_for()
    assert "not an admin key" in page.inner_text("#notice")
    page.context.close()
    page = open_page(browser, keyed.base_url)  # no key: the read-only view
    page.locator("#viewing").filter(has_text="read-only").wait_for()
    assert page.locator('#models tr[data-key="one"]').count() == 1
    assert page.locator("#models button").count() == 0 and page.locator("#keys").is_hidden()
    page.context.close()


@needs_chromium
def test_the_queue_shows_who_waits_for_the_only_slot(keyed, browser):
    """"other" holds the model's one slot with a long stream (not read on,
    so it stays open); "user"'s request waits behind it."""
    page = open_page(browser, keyed.base_url, keyed.keys["ops"])
    release = threading.Event()

    async def wait_in_line():
        async with httpx.AsyncClient(timeout=60) as h:
            task = asyncio.create_task(h.post(
                keyed.api + "/chat/completions", headers=auth(keyed, "user"),
                json={"model": "one", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2}))  # fmt: skip
            await asyncio.to_thread(release.wait, 60)
            task.cancel()  # the client leaves: the queue forgets it

    with httpx.stream("POST", keyed.api + "/chat/completions", timeout=120,
                      headers=auth(keyed, "other"),
                      json={"model": "one", "messages": [{"role": "user", "content": "count"}],
                            "max_tokens": 1900, "stream": True, "ignore_eos": True}) as held:  # fmt: skip
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        waiter = threading.Thread(target=asyncio.run, args=(wait_in_line(),))
        waiter.start()
        try:
            row = page.locator('#waiting tr[data-key="user"]')
            row.wait_for()
            assert row.locator("td").nth(0).inner_text() == "one"
            assert re.fullmatch(r"req-\S+", row.locator("td").nth(2).inner_text())
            waited = lambda: float(row.locator("td.waited").inner_text().removesuffix(" s"))  # noqa: E731
            first = waited()
            deadline = time.monotonic() + 20
            while waited() <= first:  # the page refreshes by itself: the wait grows
                assert time.monotonic() < deadline, "the wait shown did not grow"
                time.sleep(0.2)
            assert cells(page, "models")["one"][4] == "1 of 1 decoding, 1 waiting"
        finally:
            release.set()
            waiter.join(60)
    page.locator('#waiting tr[data-key="user"]').wait_for(state="detached")
    page.context.close()


def test_the_read_only_view_is_for_loopback_clients_and_can_be_turned_off(tiny_model, tmp_path):
    from conftest import serve_in_process

    from specgate.gateway.access.auth import AuthMiddleware, KeyStore
    from specgate.gateway.app import create_app
    from specgate.gateway.config import parse_config

    keys_file = tmp_path / "keys"
    admin = add_key(keys_file, "ops", admin=True)
    door = AuthMiddleware(None, KeyStore(keys_file, open_when_empty=False), False,
                          read_only_paths=frozenset({"/admin/status"}))  # fmt: skip
    for client, method, path, let_in in (
        ("127.0.0.1", "GET", "/admin/status", True), ("::1", "GET", "/admin/status", True),
        ("::ffff:127.0.0.1", "GET", "/admin/status", True),
        ("192.168.1.5", "GET", "/admin/status", False), ("127.0.0.1", "POST", "/admin/reload", False),
        ("127.0.0.1", "GET", "/admin/models", False),
    ):  # fmt: skip
        scope = {"method": method, "path": path, "client": (client, 50000)}
        assert door._viewer(scope) is let_in, (client, method, path)
    # auth.loopback_status: false (a reverse proxy on this machine): a key or nothing.
    app = create_app(parse_config({  # a model never loaded: nothing here needs one
        "server": {"host": "127.0.0.1"}, "auth": {"keys_file": str(keys_file), "loopback_status": False},
        "models": [{"id": "m", "path": str(tiny_model), "load": "on_demand"}]}))
    with serve_in_process(app) as base:
        assert httpx.get(base + "/admin/status").status_code == 401
        r = httpx.get(base + "/admin/status", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200 and r.json()["view"] == "admin"


def test_an_admin_action_from_another_sites_page_is_refused(tiny_model):
    """On an open loopback server every local caller is an admin: a web page
    of another origin open in a browser could post to /admin/* (a form post
    needs no CORS preflight). The browser's Origin header gives it away; the
    page's own posts, the CLI and the SDKs (no Origin) pass."""
    from conftest import serve_in_process

    from specgate.gateway.app import create_app
    from specgate.gateway.config import parse_config

    app = create_app(parse_config({  # a model never loaded: pinning needs none
        "server": {"host": "127.0.0.1"},
        "models": [{"id": "m", "path": str(tiny_model), "load": "on_demand"}]}))
    with serve_in_process(app) as base:
        pin = base + "/admin/models/m/pin"
        r = httpx.post(pin, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site"
        assert httpx.post(pin, headers={"Origin": "http://127.0.0.1:1"}).status_code == 403
        assert httpx.post(pin, headers={"Origin": base}).json()["pin"] is True
        assert httpx.post(base + "/admin/models/m/unpin").json()["pin"] is False
        assert httpx.get(base + "/admin/status", headers={"Origin": "http://evil.example"}
                         ).status_code == 200  # a read: no CORS header lets that page see it
