"""A batch trial through a real gateway: a busy model moves its requests onto
the MTP engine's batch together, times those rounds, and every stream's
output is still plain greedy decoding's (issue 45).

The policy's lone estimates are pinned (failure injection, as in
test_plan_switch.py: this CPU cannot show speculation winning on a model
this small): plain steps at 10 ms at any batch size, an MTP round at
10 + 1 ms per draft, every draft accepted. Alone a request speculates;
busy, the rule would batch plainly, and a lone round's small extra cost
leaves a batch a chance (policies/model_policy._batch_may_win), so the
first busy arrival starts a trial. Batched rounds are not pinned: the
trial measures them on this machine for real.
"""

from __future__ import annotations

import random
import re
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.conftest import in_process_gateway
from tests.test_plan_switch import PinnedAcceptance, PinnedCosts

N = 160


class PinnedLoneCosts(PinnedCosts):
    """test_plan_switch's pinned costs with a cheap draft (1 ms): a batch
    of a few streams then has the clear chance a trial needs."""

    per_draft = 0.001


@pytest.fixture(scope="module")
def gw(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-trial")
    config = {"models": [
        {"id": "trial", "path": str(tiny_model), "engines": ["mlx_plain", "mlx_mtp"],
         "mtp_depth": 2, "max_context": 2048,
         "policy": {"request_floor": 0}}]}  # fmt: skip
    with in_process_gateway(config, tmp / "home") as (app, base):
        served = app.state.registry.models["trial"]
        policy = served.policy
        policy.costs = policy.constrained_costs = PinnedLoneCosts()
        policy.acceptance = PinnedAcceptance()
        yield SimpleNamespace(base_url=base, api=base + "/v1", served=served)


def counters(gw, name: str) -> dict[tuple, float]:
    text = httpx.get(gw.base_url + "/metrics").text
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("model") == "trial":
            out[tuple(sorted(labels.items()))] = float(m.group(2))
    return out


def test_a_busy_model_runs_a_batch_trial_and_every_stream_stays_exact(gw):
    client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
    prompts = [[random.Random(s).randrange(2000) for _ in range(16)] for s in range(3)]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        r = client.completions.create(model="trial", prompt=prompts[i], max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        got[i] = r.choices[0].token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and len(got) == 3
    for i, prompt in enumerate(prompts):
        want = client.completions.create(model="trial", prompt=prompt, max_tokens=N, temperature=0,
                                         extra_headers={"X-Specgate-Method": "none"},
                                         extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert got[i] == want.choices[0].token_ids, i
    decided = counters(gw, "specgate_plan_decisions_total")
    trial = {"method": "mtp", "reason": "concurrency", "source": "explore"}
    assert sum(v for k, v in decided.items() if trial.items() <= dict(k).items()) >= 1, decided
    batched = counters(gw, "specgate_spec_decode_batch_rounds_total")
    assert sum(v for k, v in batched.items() if int(dict(k)["batch"]) > 1) >= 1, batched
    explored = counters(gw, "specgate_policy_explorations_total")
    assert sum(v for k, v in explored.items() if dict(k)["method"] == "mtp") >= 1, explored
