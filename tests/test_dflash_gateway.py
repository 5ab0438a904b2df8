"""A DFlash engine behind the gateway: configured, planned, exact, measured."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from specgate.builders.drafters import build_dflash_drafter
from tests.conftest import start_gateway, stop_gateway


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gw-dflash")
    drafter = build_dflash_drafter(root / "dflash", target=tiny_model, block_size=6,
                                   num_hidden_layers=1, tokenizer=False)
    g = start_gateway({"models": [
        {"id": "tiny-dflash", "path": str(tiny_model), "engines": ["mlx_plain", "mlx_dflash"],
         "drafter": str(drafter), "max_context": 2048},
    ]}, root)
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)


def test_planned_exact_and_measured(gw, client):
    prompt = "def main():\n"
    texts = {}
    for method in ("dflash", "none"):
        raw = client.completions.with_raw_response.create(
            model="tiny-dflash", prompt=prompt, max_tokens=40, temperature=0,
            extra_headers={"X-Specgate-Method": method})
        texts[method] = raw.parse().choices[0].text
    assert texts["dflash"] == texts["none"] and texts["none"]
    # Alone on the model, the policy plans from what those two requests
    # measured: any depth up to the block's 5 drafts, or plain decoding.
    raw = client.completions.with_raw_response.create(model="tiny-dflash", prompt=prompt,
                                                      max_tokens=40, temperature=0)
    assert re.fullmatch(r"method=(dflash;depth=[1-5];reason=spec_on|none;depth=0;"
                        r"reason=measured_loss);source=(live|explore|rule)",
                        raw.headers["x-specgate-plan"])
    stream = client.completions.create(model="tiny-dflash", prompt=prompt, max_tokens=40,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == texts["none"]
    metrics = httpx.get(gw.base_url + "/metrics").text
    assert 'specgate_spec_decode_num_drafts_total{method="dflash",model="tiny-dflash"}' in metrics
    with pytest.raises(openai.BadRequestError, match="at most 5"):
        client.completions.create(model="tiny-dflash", prompt=prompt, max_tokens=4,
                                  extra_headers={"X-Specgate-Depth": "6"})
