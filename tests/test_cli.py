"""`specgate serve` with no config serves the shipped demo model."""

from __future__ import annotations

import openai
from conftest import start_gateway, stop_gateway

from engines.checkpoints.default_model import DEFAULT_MODEL_ID


def test_serve_without_config_serves_the_demo(tmp_path):
    home = tmp_path / "home"
    gw = start_gateway(None, tmp_path, home=home)
    try:
        client = openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_ID]
        out = client.completions.create(
            model=DEFAULT_MODEL_ID, prompt="import os\nimport sys\n\n\ndef main():\n",
            max_tokens=24, temperature=0)
        assert out.usage.completion_tokens >= 1
        # The trained model writes Python, not noise.
        assert out.choices[0].text.strip()
        assert "\ufffd" not in out.choices[0].text
    finally:
        stop_gateway(gw)
    assert not home.exists()  # nothing written: the model ships in the package
