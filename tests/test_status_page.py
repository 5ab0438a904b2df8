"""The status page in a real headless browser (Debian's chromium; .ci/run
installs it): loaded from a live gateway that has served plain and MTP
requests, its script fills the tables from /admin/status, and what the
browser rendered is read back from its DOM. A screenshot goes to
bench/results/status-page.png for the notes. The data endpoint itself is
checked for its shape and its key."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.gateway.access.keys import add_key

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = REPO / "bench" / "results" / "status-page.png"


class Tables(HTMLParser):
    """Every <table id=...>'s body rows, as lists of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.texts: dict[str, str] = {}
        self._table = self._row = self._cell = self._id = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id", ""), [])
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._table is not None and getattr(self, "_in_body", False):
            self._row = []
            self._table.append(self._row)
        elif tag == "td" and self._row is not None:
            self._cell = []
        if "id" in attrs and tag != "table":
            self._id, self.texts[attrs["id"]] = attrs["id"], ""

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._table = self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None:
            self.texts[self._id] += data


def browse(url: str, *extra: str) -> str:
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--virtual-time-budget=8000", "--window-size=1400,1200", *extra, url],
        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    gw = start_gateway({"models": [
        {"id": "tiny", "path": str(tiny_model), "max_context": 2048},
        {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"]},
        {"id": "later", "path": str(tiny_model), "load": "on_demand"},
    ]}, tmp_path_factory.mktemp("status"))  # fmt: skip
    c = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    for model in ("tiny", "demo"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "def f(x):"}],
                                  max_tokens=24, temperature=0)  # fmt: skip
    yield gw
    stop_gateway(gw)


def test_the_status_data_says_what_the_page_shows(served):
    s = httpx.get(served.base_url + "/admin/status").json()
    states = {m["id"]: m["state"] for m in s["models"]}
    assert states == {"tiny": "ready", "demo": "ready", "later": "unloaded"}
    assert {p["method"] for p in s["plans"]["demo"]} <= {"mtp", "none"} and s["plans"]["tiny"]
    assert s["keys"]["anonymous"]["requests"]["ok"] == 2
    assert s["requests"] == []  # nothing decoding now


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")
def test_the_page_in_a_headless_browser(served):
    page = Tables()
    page.feed(browse(served.base_url + "/", "--dump-dom"))
    models = {row[0]: row for row in page.tables["models"]}
    assert set(models) == {"tiny", "demo", "later"}
    assert models["demo"][1] == "ready" and models["later"][1] == "unloaded"
    # the memory column: its total, then weights and KV apart
    assert re.match(r"[\d.]+ GiB \(weights [\d.]+ GiB, KV [\d.]+ GiB\)$", models["demo"][2]), models
    assert "mlx_mtp" in models["demo"][3]
    assert "on_demand" in models["later"][6]
    plans = {(row[0], row[1]) for row in page.tables["plans"]}
    assert ("tiny", "none") in plans
    keys = {row[0]: row for row in page.tables["keys"]}
    assert "ok 2" in keys["anonymous"][1]
    assert page.tables["requests"] == [["none"]]
    assert "3 models" in page.texts["summary"] and "loading" not in page.texts["summary"]
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    browse(served.base_url + "/", f"--screenshot={SCREENSHOT}")
    assert SCREENSHOT.stat().st_size > 10_000


def test_the_page_is_open_and_its_data_needs_an_admin_key(tiny_model, tmp_path):
    keys_file = tmp_path / "keys"
    user, admin = add_key(keys_file, "user"), add_key(keys_file, "ops", admin=True)
    gw = start_gateway({"auth": {"keys_file": str(keys_file)},
                        "models": [{"id": "tiny", "path": str(tiny_model)}]}, tmp_path)  # fmt: skip
    try:
        r = httpx.get(gw.base_url + "/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/admin/status" in r.text and "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert httpx.get(gw.base_url + "/admin/status").status_code == 401
        assert httpx.get(gw.base_url + "/admin/status",
                         headers={"Authorization": f"Bearer {user}"}).status_code == 403
        r = httpx.get(gw.base_url + "/admin/status", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200 and r.json()["models"][0]["id"] == "tiny"
    finally:
        stop_gateway(gw)
