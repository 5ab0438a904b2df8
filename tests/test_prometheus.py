"""The shipped Grafana dashboard against a real Prometheus scraping a real gateway.

Every query in deploy/grafana/dashboards/specgate.json must parse and return
data once the gateway has served a few plain and speculative requests, so
the dashboard cannot drift from the metric names. The gateway has API keys
and keeps /metrics behind one, so Prometheus scrapes with a key as the
shipped prometheus.yml explains, and the per-key panels see real keys. Prometheus is Debian's
package (.ci/run installs it), on a loopback port, its data in tmp.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import httpx
import openai
import pytest
import yaml

from specgate.gateway.access.keys import add_key
from tests.conftest import REPO, reserved_ports, start_gateway, stop_gateway

DASHBOARD = REPO / "deploy/grafana/dashboards/specgate.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool") or "promtool"  # the same Debian package
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".*"}

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus)"
)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, Grafana variables substituted."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unsubstituted variable in {panel['title']!r}: {expr}"
            out.append((panel["title"], expr))
    return out


@pytest.fixture
def gw(tiny_model, tmp_path):
    keys_file = tmp_path / "keys"
    keys = {"team": add_key(keys_file, "team"), "scraper": add_key(keys_file, "scraper", models=[]),
            "limited": add_key(keys_file, "limited", rpm=1)}
    gw = start_gateway(
        {"auth": {"keys_file": str(keys_file), "metrics_requires_key": True},
         "models": [
            {"id": "tiny", "path": str(tiny_model), "max_context": 2048},
            {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp", "mlx_ngram"]},
        ]},
        tmp_path,
    )
    gw.keys = keys
    yield gw
    stop_gateway(gw)


@pytest.fixture
def prometheus(gw, tmp_path):
    """A Prometheus scraping the gateway every second; killed (its whole
    process group) at the end, whatever happens."""
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "specgate",
            "authorization": {"type": "Bearer", "credentials": gw.keys["scraper"]},
            "static_configs": [{"targets": [gw.base_url.removeprefix("http://")]}],
        }],
    }))
    port = reserved_ports()  # told before it starts: from the range no process is given by chance
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"prometheus exited:\n{log.read_text()}"
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready:\n{log.read_text()}"
            time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n{body}"
    return body["data"]["result"]


def wait_scraped(prom: str, requests: int, timeout: float = 20) -> None:
    """Until Prometheus holds a scrape taken after `requests` requests finished."""
    deadline = time.monotonic() + timeout
    while True:
        result = query(prom, "sum(specgate_requests_total)")
        if result and float(result[0]["value"][1]) >= requests:
            return
        assert time.monotonic() < deadline, f"Prometheus never saw {requests} requests: {result}"
        time.sleep(0.2)


def serve_a_few(gw, salt: str) -> int:
    """Plain and speculative, streamed and not, one request over its key's
    rpm and one with a bad key; returns how many requests finished."""
    client = openai.OpenAI(base_url=gw.api, api_key=gw.keys["team"], max_retries=0, timeout=60)
    limited = openai.OpenAI(base_url=gw.api, api_key=gw.keys["limited"], max_retries=0)
    limited_requests = 0
    with pytest.raises(openai.RateLimitError):  # rpm 1: within a minute, the second is refused
        for _ in range(2):
            limited_requests += 1
            limited.completions.create(model="tiny", prompt=salt, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.api, api_key="sg-bad.key", max_retries=0).models.list()
    prompt = f"def {salt}(x):\n"
    mtp, plain = {"X-Specgate-Method": "mtp"}, {"X-Specgate-Method": "none"}
    client.completions.create(model="demo", prompt=prompt, max_tokens=48, temperature=0,
                              extra_headers=mtp)
    "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt=prompt, max_tokens=48, temperature=0, stream=True,
        extra_headers=mtp))
    client.completions.create(model="demo", prompt=prompt, max_tokens=24, extra_headers=plain)
    # Copies from the context: the demo repeats itself, after rounds with nothing to copy.
    client.completions.create(model="demo", prompt=prompt, max_tokens=64, temperature=0,
                              extra_headers={"X-Specgate-Method": "ngram"})
    # Unforced and alone on the model: the policy's own choice.
    client.chat.completions.create(model="demo", messages=[{"role": "user", "content": salt}],
                                   max_tokens=24)
    list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": salt}], max_tokens=16, stream=True))
    client.completions.create(model="tiny", prompt=prompt, max_tokens=16)
    return 7 + limited_requests  # a refused one counts too, as status "rejected"


@pytest.mark.timeout(120)
def test_every_dashboard_query_returns_data(gw, prometheus):
    shipped = REPO / "deploy/prometheus.yml"
    check = subprocess.run([PROMTOOL, "check", "config", str(shipped)], capture_output=True)
    assert check.returncode == 0, f"{shipped}: {check.stdout.decode()}{check.stderr.decode()}"

    # Two batches, each seen by a scrape: rate() over the window then has an
    # increase to measure (a series' first sample is not one).
    n = serve_a_few(gw, "first")
    wait_scraped(prometheus, n)
    n += serve_a_few(gw, "second")
    wait_scraped(prometheus, n)

    queries = dashboard_queries()
    assert len(queries) >= 10
    for title, expr in queries:
        result = query(prometheus, expr)
        values = [float(s["value"][1]) for s in result]
        assert any(not math.isnan(v) for v in values), f"{title!r}: no data from {expr}: {result}"

    # The model selector's values.
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    for var in (v for v in variables if v["type"] == "query"):
        m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"])
        assert m, var["definition"]
        r = httpx.get(f"{prometheus}/api/v1/label/{m[2]}/values", params={"match[]": m[1]}).json()
        assert r["status"] == "success" and {"tiny", "demo"} <= set(r["data"]), r
