"""`specgate tune`: measured costs, saved per machine and model, read back by the gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_tune_measures_saves_and_the_gateway_reads_it(tiny_model, tmp_path):
    env = os.environ | {"SPECGATE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "tune", str(tiny_model),
                           "--reps", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verify at context 4096" in done.stdout and "plain decoding step" in done.stdout
    assert "mtp round: 1:" in done.stdout
    saved = list((tmp_path / "tune").rglob("*.json"))
    assert len(saved) == 1
    data = json.loads(saved[0].read_text())
    assert data["verify"]["64"]["1"] == 1.0 and len(data["verify"]["64"]) == 16
    assert set(data["draft"]) == {"mtp"}  # the tiny model has an MTP head
    assert sorted(map(int, data["rounds_seconds"]["mtp"])) == list(range(1, 9))
    assert data["plain_step"] > 0
    assert data["batched"]["1"] == 1.0 and len(data["batched"]) == 8

    code = ("from gateway.tuning import costs_for; import sys; c = costs_for(sys.argv[1]); "
            "print(c.verify_cost(4, 64), c.verify_cost(4, 100000), c.batched_gain(8), "
            "c.draft['mtp'](3) > 0)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    short, long, gain, head = out.stdout.split()
    assert float(short) > 1.0 and float(long) >= float(short) * 0.8 and float(gain) > 0
    assert head == "True"


def test_draft_fit_recovers_a_linear_round_cost():
    """Rounds that cost verify(k+1) + 0.5 + 0.25 k (in c(1) units) give back
    exactly that drafter cost; one depth gives a per-round cost alone."""
    from kernels.tune import draft_fit

    c1 = 0.01
    verify = {m: c1 * (1 + 0.3 * (m - 1)) for m in range(1, 10)}
    rounds = {k: verify[k + 1] + c1 * (0.5 + 0.25 * k) for k in range(1, 9)}
    fit = draft_fit(rounds, verify, c1)
    assert abs(fit["per_round"] - 0.5) < 1e-9 and abs(fit["per_token"] - 0.25) < 1e-9
    one = draft_fit({3: rounds[3]}, verify, c1)
    assert abs(one["per_round"] - 1.25) < 1e-9 and one["per_token"] == 0.0
