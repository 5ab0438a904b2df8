"""Greedy text through llama.cpp does not depend on llama-server's prompt cache.

The real SmolLM2 GGUF under `llamacpp`, through a real gateway and the openai
SDK. The same temperature-0 request twice: first with the slot's cache holding
nothing of it (cold), then with all of it but its last token cached (warm). On
llama-server's defaults the warm one evaluates that token alone, other kernels
than the cold batch used (adapter.py, Determinism), and on this prompt the
greedy text changes within 64 tokens; specgate sends deterministic requests
uncached, so both are the cold text.
"""

from __future__ import annotations

import openai
import pytest

from tests.conftest import start_gateway, stop_gateway

pytestmark = pytest.mark.timeout(1800)  # the first use on a machine builds llama-server

# From bench/llamacpp_divergence.py's corpus (104 prompt tokens: a batch
# past flash attention's 64-row tile): on llama-server's defaults, cold and
# warm differ at the first token.
PROMPT = """Rewrite this function using `let` replaced by `var`, printing all of it:

function debounce(fn, wait) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), wait);
  };
}
"""
TOKENS = 64


@pytest.fixture(scope="module")
def client(smollm2_gguf, llama_server_binary, tmp_path_factory):
    model = {"id": "smol", "path": str(smollm2_gguf), "engines": ["llamacpp"],
             "max_concurrent": 1, "max_context": 1024,
             # One thread: see tests/test_llamacpp_gateway.py. --no-repack: this
             # CPU's AMX repack path crashes on Q4_1 (issue 42).
             "llamacpp": {"threads": 1, "extra_args": ["--no-repack"]}}  # fmt: skip
    gw = start_gateway(
        {"llama_server": {"binary": str(llama_server_binary)}, "models": [model]},
        tmp_path_factory.mktemp("gw-exact"),
    )
    yield openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=300)
    stop_gateway(gw)


def greedy(client, content: str, **extra) -> str:
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": content}],
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **extra,
    )
    return r.choices[0].message.content


def test_cold_and_warm_prompt_cache_give_one_greedy_text(client):
    cold = greedy(client, PROMPT)  # the process's first request: nothing cached
    warm = greedy(client, PROMPT)  # all but the last prompt token would come from the cache
    assert warm == cold
    assert greedy(client, PROMPT, seed=3) == cold  # a seed asks for determinism too
