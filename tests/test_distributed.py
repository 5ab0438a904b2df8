"""One model over two processes: `mlx.launch -n 2 --backend ring` on
loopback running specgate with the demo model split by tensor and by
pipeline parallelism, through the real openai SDK, against the
single-process server (conftest's `gateway`, the same model and depth)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.gateway.config import ConfigError, parse_config

DEMO = {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"], "mtp_depth": 3}
PROMPTS = ["def fibonacci(n):", "The river was"]
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def launch(tmp_path, mode: str, **distributed):
    spread = {"distributed": {"mode": mode, **distributed}}
    return start_gateway({"models": [DEMO | spread]}, tmp_path, ranks=2)


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def spread(request, tmp_path_factory):
    gw = launch(tmp_path_factory.mktemp(f"spread-{request.param}"), request.param)
    yield gw
    stop_gateway(gw)
    assert gone(gw)  # mlx.launch and both ranks


def gone(gw, timeout: float = 60) -> bool:
    """Whether every rank has exited (rank 0 drains first: shutdown_grace_s)."""
    deadline = time.monotonic() + timeout
    while ranks_of(gw) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not ranks_of(gw)


def ranks_of(gw) -> dict[int, int]:
    """rank -> pid of the launched specgate processes still running."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        rank = next((int(e[9:]) for e in env if e.startswith(b"MLX_RANK=")), None)
        # Its own config file tells this server's ranks from another's (all have --port 0).
        config = b"\0--config\0" + bytes(gw.config_path) + b"\0"
        if rank is not None and b"\0-m\0specgate\0serve\0" in cmd and config in cmd:
            found[rank] = int(entry.name)
    return found


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=180)


def complete(gw, prompt: str, method: str, max_tokens: int = 20, **kw):
    return client(gw).completions.with_raw_response.create(
        model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_headers={"X-Specgate-Method": method}, **kw)


# The single-process server's greedy answers, asked once per run and compared
# with each mode's (greedy: the same request gets the same answer).
_REFERENCE: dict[tuple, object] = {}


def reference(gateway, kind: str, prompt: str, method: str, max_tokens: int = 20):
    key = (gateway.base_url, kind, prompt, method, max_tokens)
    if key not in _REFERENCE:
        if kind == "chat":
            _REFERENCE[key] = client(gateway).chat.completions.create(
                model="demo", messages=CHAT, max_tokens=max_tokens, temperature=0,
                extra_headers={"X-Specgate-Method": method}).choices[0].message.content
        else:
            _REFERENCE[key] = complete(gateway, prompt, method, max_tokens, logprobs=1).parse()
    return _REFERENCE[key]


@pytest.mark.parametrize("method", ["none", "mtp"])
def test_greedy_equals_the_single_process_server(spread, gateway, method):
    assert sorted(ranks_of(spread)) == [0, 1]
    for prompt in PROMPTS:
        raw = complete(spread, prompt, method, logprobs=1)
        assert raw.headers["x-specgate-plan"].startswith(f"method={method}")
        got, want = raw.parse(), reference(gateway, "completion", prompt, method)
        assert got.choices[0].text == want.choices[0].text, (prompt, method)
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens  # token for token
    got = client(spread).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=24, temperature=0, stream=True,
        extra_headers={"X-Specgate-Method": method})
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text == reference(gateway, "chat", "", method, 24)


def test_concurrent_requests_batch_in_step(spread, gateway):
    """Three at once: plain batched decoding on both ranks (and sampled ones,
    whose seeds rank 0 chose); then greedy still matches, so no rank drifted."""
    results: dict[int, str] = {}

    def one(i: int) -> None:
        r = client(spread).completions.create(model="demo", prompt=PROMPTS[i], max_tokens=16,
                                              temperature=0)  # fmt: skip
        results[i] = r.choices[0].text

    sampled = [threading.Thread(target=lambda: client(spread).completions.create(
        model="demo", prompt="Once", max_tokens=8, temperature=0.9)) for _ in range(2)]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))] + sampled
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, prompt in enumerate(PROMPTS):
        want = client(gateway).completions.create(model="demo", prompt=prompt, max_tokens=16,
                                                  temperature=0).choices[0].text  # fmt: skip
        assert results[i] == want
    assert complete(spread, PROMPTS[0], "mtp").parse().choices[0].text == \
        reference(gateway, "completion", PROMPTS[0], "mtp").choices[0].text


def test_a_client_that_leaves_frees_both_ranks(spread):
    with httpx.stream("POST", spread.api + "/completions", timeout=120, json={
            "model": "demo", "prompt": "Count:", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}, headers={"X-Specgate-Method": "mtp"}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break
    # Both ranks went on to the next request: it is served, and in step.
    assert complete(spread, PROMPTS[1], "none").parse().choices[0].text


def test_an_idle_rank_waits_without_polling(spread):
    """Between requests rank 1 blocks on rank 0's doorbell (specgate/engines/distributed/doorbell.py);
    waiting in MLX's ring receive, it polled at most of a core."""
    complete(spread, PROMPTS[0], "mtp", max_tokens=4)
    follower = ranks_of(spread)[1]
    time.sleep(0.5)  # the request's last section ends
    before = cpu_seconds(follower)
    time.sleep(1.5)  # polling took most of a core: over a second of CPU here
    used = cpu_seconds(follower) - before
    assert used < 0.15, f"rank 1 used {used:.2f} s of CPU in 1.5 s with nothing to do"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_serve_without_mlx_launch_says_what_to_run(tmp_path):
    config = tmp_path / "spread.yaml"
    config.write_text("models:\n  - {id: demo, path: 'builtin:demo', distributed: {mode: pipeline,"
                      " hostfile: macs.json}}\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MLX_RANK"}
    done = subprocess.run([sys.executable, "-m", "specgate", "serve", "--config", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "mlx.launch --hostfile macs.json --backend ring --" in done.stderr


def test_what_a_distributed_model_may_be():
    ok = parse_config({"models": [DEMO | {"distributed": {}}]})
    assert ok.models[0].pin and ok.models[0].distributed.mode == "tensor"
    for bad, words in (
        ({"models": [DEMO | {"engines": ["mlx_plain", "mlx_dflash"], "drafter": "builtin:demo-dflash",
                             "distributed": {}}]}, "do not run over several ranks"),
        ({"models": [{"id": "g", "path": "builtin:demo-gguf", "distributed": {}}]}, "MLX models only"),
        ({"models": [DEMO | {"load": "on_demand", "distributed": {}}]}, "loads at start"),
        ({"models": [DEMO | {"distributed": {}}, DEMO | {"id": "b", "distributed": {}}]},
         "one distributed model per server"),
        ({"models": [DEMO | {"distributed": {"mode": "expert"}}]}, "distributed.mode"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            parse_config(bad)



def test_the_two_macs_example_is_a_valid_config_and_hostfile():
    import json

    import jsonschema_rs
    import yaml
    from mlx._distributed_utils.common import Hostfile

    example = REPO / "deploy/examples/two-macs"
    config = yaml.safe_load((example / "specgate.yaml").read_text())
    schema = json.loads((REPO / "deploy/specgate.schema.json").read_text())
    jsonschema_rs.validate(schema, config)
    hosts = Hostfile.from_file(str(example / "hosts.json"))
    assert hosts.backend == config["models"][0]["distributed"]["backend"] == "jaccl"
    assert [h.rdma[i] for i, h in enumerate(hosts.hosts)] == [None, None]  # each rank's own: none
