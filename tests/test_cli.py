"""`specgate serve` with no config serves the embedded demo model."""

from __future__ import annotations

import openai
from conftest import start_gateway, stop_gateway

from engines.checkpoints.default_model import DEFAULT_MODEL_ID

PROGRESS = "building the embedded demo model"


def test_serve_without_config_builds_and_serves_the_demo(tmp_path):
    home = tmp_path / "home"
    gw = start_gateway(None, tmp_path, home=home)
    try:
        client = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_ID]
        out = client.chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
        assert out.usage.completion_tokens >= 1
    finally:
        stop_gateway(gw)
    assert gw.log().count(PROGRESS) == 1
    assert any((home / "models").iterdir())
    # Built once: the second start reuses it without a word.
    (tmp_path / "again").mkdir()
    gw = start_gateway(None, tmp_path / "again", home=home)
    stop_gateway(gw)
    assert PROGRESS not in gw.log()
