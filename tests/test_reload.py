"""Hot reload through a real server: POST /admin/reload and SIGHUP re-read
the config; a model added appears, one removed goes, one changed is served
anew, and a stream in flight on an unchanged model completes; a bad file
changes nothing and says where it is wrong, an alias bomb or binary junk
included (at a reload, and at `specgate serve`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from conftest import REPO, start_gateway, stop_gateway

from specgate.gateway.operator.cli import main


def model(model_id: str, path, **extra) -> dict:
    return {"id": model_id, "path": str(path), "max_context": 2048, "max_concurrent": 2, **extra}


@pytest.fixture
def reloadable(tiny_model, tmp_path):
    config = {"models": [model("keep", tiny_model), model("gone", tiny_model),
                         model("change", tiny_model, engines=["mlx_plain", "mlx_ngram"],
                               mlx_ngram={"depth": 6})]}  # fmt: skip
    gw = start_gateway(config, tmp_path)
    gw.config_file = tmp_path / "specgate.yaml"
    gw.config = yaml.safe_load(gw.config_file.read_text())
    yield gw
    stop_gateway(gw)


def served(gw) -> set[str]:
    return {m.id for m in openai.OpenAI(base_url=gw.api, api_key="none").models.list()}


def ask(gw, model_id: str) -> str:
    c = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    return c.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2, temperature=0).choices[0].finish_reason  # fmt: skip


def rewrite(gw, models: list[dict], **top) -> None:
    gw.config_file.write_text(yaml.safe_dump(gw.config | {"models": models} | top))


def test_reload_adds_removes_and_changes_models_while_a_stream_completes(reloadable, tiny_model):
    gw = reloadable
    with httpx.stream("POST", gw.api + "/chat/completions", timeout=120, json={
            "model": "keep", "messages": [{"role": "user", "content": "count"}], "max_tokens": 1500,
            "temperature": 0, "stream": True, "ignore_eos": True}) as stream:  # fmt: skip
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        rewrite(gw, [model("keep", tiny_model), model("change", tiny_model, engines=["mlx_plain", "mlx_ngram"],
                                                      mlx_ngram={"depth": 7}),
                     model("new", tiny_model, load="on_demand")],
                server=gw.config["server"] | {"max_body_bytes": "12345B"})  # fmt: skip
        r = httpx.post(gw.base_url + "/admin/reload", timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["models"] == {"added": ["new"], "removed": ["gone"], "changed": ["change"],
                                  "unchanged": ["keep"]}  # fmt: skip
        assert body["restart_needed"] == ["server.max_body_bytes"]
        assert served(gw) == {"keep", "change", "new"}
        with pytest.raises(openai.NotFoundError):
            ask(gw, "gone")
        assert ask(gw, "new") == "length" and ask(gw, "change") == "length"
        tail = [line for line in lines if line.startswith("data: ")]
    assert tail[-1] == "data: [DONE]" and '"finish_reason":"length"' in tail[-2].replace(" ", "")
    models = {m["id"]: m for m in httpx.get(gw.base_url + "/admin/models").json()["models"]}
    assert models["keep"]["loads"] == 1  # untouched: never reloaded


# A "billion laughs": nine levels of nine aliases, 9^9 strings once expanded,
# in a few hundred bytes. (Once it blocked the event loop for minutes and
# took 14.8 GB.)
BOMB = "lol0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9)
)
JUNK = bytes(range(256)) * 16  # not UTF-8: a binary file


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    kib = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kib) << 10


def test_a_bad_config_changes_nothing_and_sighup_reloads(reloadable, tiny_model, capsys):
    gw = reloadable
    rewrite(gw, [model("keep", tiny_model, engines=["mlx_plain", "mlx_ngram"], mlx_ngram={"depth": 99})])
    r = httpx.post(gw.base_url + "/admin/reload", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_config"
    assert f"{gw.config_file}: models.0.mlx_ngram.depth" in r.json()["error"]["message"]
    assert served(gw) == {"keep", "gone", "change"} and ask(gw, "gone") == "length"
    assert main(["reload", "--url", gw.base_url]) == 1  # the CLI says the same
    assert "400: config not reloaded, the running one stays" in capsys.readouterr().err

    # An alias bomb beside valid models, and binary junk: each a 400 in the
    # API's shape at once (the timeout is a hang guard), memory as it was.
    before = resident_bytes(gw.process.pid)
    gw.config_file.write_text(yaml.safe_dump(gw.config) + BOMB)
    r = httpx.post(gw.base_url + "/admin/reload", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_config", r.text
    assert "aliases expand to more than" in r.json()["error"]["message"], r.text
    gw.config_file.write_bytes(JUNK)
    r = httpx.post(gw.base_url + "/admin/reload", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_config", r.text
    assert "not UTF-8 text" in r.json()["error"]["message"], r.text
    assert resident_bytes(gw.process.pid) - before < 200 << 20
    assert served(gw) == {"keep", "gone", "change"} and ask(gw, "keep") == "length"

    rewrite(gw, [model("keep", tiny_model)])
    os.kill(gw.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while served(gw) != {"keep"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served(gw) == {"keep"} and ask(gw, "keep") == "length" and gw.alive()


def test_serve_refuses_binary_junk_and_an_alias_bomb_with_a_clear_error(tmp_path):
    for name, content in (("junk.yaml", JUNK), ("bomb.yaml", BOMB.encode())):
        path = tmp_path / name
        path.write_bytes(content)
        done = subprocess.run(
            [sys.executable, "-m", "specgate", "serve", "--port", "0", "--config", str(path)],
            cwd=REPO, env=os.environ | {"SPECGATE_HOME": str(tmp_path / "home")},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (name, done.stderr[-2000:])
        assert done.stderr.startswith(f"specgate: bad config\n{path}: "), done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        want = "not UTF-8 text" if name == "junk.yaml" else "aliases expand to more than"
        assert want in done.stderr, done.stderr
