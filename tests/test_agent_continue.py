"""Continue CLI (`cn -p`, pinned in tests/agent_clis.py) completes a turn
against a real gateway serving the shipped demo model, wired as its docs
say: a config.yaml whose model has provider `openai`, `apiBase` the
gateway's /v1, any `apiKey`, and the model's id.

The demo model is no chat model: what it says is noise, but it says it
through the tool-capable chat template every request of cn carries tools
for. `defaultCompletionOptions.maxTokens` bounds its answer (cn sends it as
`max_tokens`; without it the demo writes its default 4096 tokens, about 90 s
here); the turn is then ~2k prompt tokens (Continue's system prompt and nine
tool definitions) and 64 generated: 9-14 s of cn on 2 busy cores.
"""

from __future__ import annotations

import re
import subprocess
import time

import httpx
import pytest
import yaml
from agent_clis import agent_env
from conftest import start_gateway, stop_gateway

pytestmark = pytest.mark.agents

MODEL = "specgate-demo"  # what `specgate serve` with no config serves
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def demo_gateway(tmp_path_factory):
    gw = start_gateway(None, tmp_path_factory.mktemp("continue-gateway"))
    yield gw
    stop_gateway(gw)


def _counter(gw, name: str) -> float:
    text = httpx.get(gw.base_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def test_cn_print_completes_a_turn(demo_gateway, agent_cli, tmp_path):
    cn = agent_cli("continue")
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    config = tmp_path / "config.yaml"
    model = {"name": MODEL, "provider": "openai", "model": MODEL, "apiBase": demo_gateway.api,
             "apiKey": "sk-local", "roles": ["chat", "edit", "apply"],
             "defaultCompletionOptions": {"maxTokens": MAX_TOKENS, "temperature": 0}}  # fmt: skip
    config.write_text(yaml.safe_dump({"name": "specgate", "version": "1.0.0", "schema": "v1",
                                      "models": [model]}))  # fmt: skip
    prompt_before = _counter(demo_gateway, "specgate_prompt_tokens_total")
    generated_before = _counter(demo_gateway, "specgate_generation_tokens_total")

    t0 = time.monotonic()
    done = subprocess.run(
        [str(cn), "--config", str(config), "-p", "Say hello in one short sentence."],
        cwd=workdir, env=agent_env(home, CONTINUE_CLI_ENABLE_TELEMETRY="0"),
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    took = time.monotonic() - t0

    log = demo_gateway.log()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-3000:])
    assert done.stdout.strip(), done.stderr[-2000:]
    chats = re.findall(r"method=POST path=/v1/chat/completions .* status=(\d+) ", log)
    assert chats and set(chats) == {"200"}, chats
    assert not re.search(r"specgate\.access: .* status=4\d\d ", log), log[-3000:]
    prompt = _counter(demo_gateway, "specgate_prompt_tokens_total") - prompt_before
    generated = _counter(demo_gateway, "specgate_generation_tokens_total") - generated_before
    # Continue's system prompt and tool definitions went through the demo's template.
    assert prompt > 1000 and 0 < generated <= MAX_TOKENS * len(chats), (prompt, generated)
    print(f"cn -p: {len(chats)} request(s), {prompt:.0f} prompt tokens, "
          f"{generated:.0f} generated, {took:.1f} s")  # fmt: skip
