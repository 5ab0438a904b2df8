"""Fuzzing the HTTP API with schemathesis, from specgate's own OpenAPI schema.

A real gateway on a loopback port (a tiny model, small context so each
generated request is quick), schemathesis's CLI against /openapi.json with
every phase it can run, bounded by examples per operation and total time.
Checks: no 5xx, and no request slower than the per-request timeout (a hang).
Afterwards the server still answers /health and a real completion. The admin
routes are left out: fuzzing them unloads the model under test, after which
its 503s are the right answer (tests/test_auth.py covers them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, start_gateway, stop_gateway


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_model, tmp_path_factory):
    gw = start_gateway(
        {"server": {"max_body_bytes": "64KiB"},
         "models": [{"id": "tiny", "path": str(tiny_model), "max_concurrent": 4,
                     "max_context": 256}]},  # fmt: skip
        tmp_path_factory.mktemp("fuzz"),
    )
    yield gw
    stop_gateway(gw)


# The fast tier: the first examples of every operation and phase (the seed is
# fixed, so they are the proof tier's first ones too); the proof tier: more.
# Time bounds the fast tier's run, not the examples (schemathesis generated
# ~2,000 cases in 30 s at any --max-examples from 3 to 8): 15 s is ~800 cases
# on an idle machine, fewer operations on a loaded one; the proof tier's 150 s
# runs the long search over every operation.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("examples,seconds", [
    (8, 15), pytest.param(40, 150, marks=pytest.mark.proof)])  # fmt: skip
def test_schemathesis_finds_no_5xx_and_no_hang(fuzz_gateway, tmp_path, examples, seconds):
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert cli, "schemathesis is a dev dependency"
    env = os.environ | {"SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "SPECGATE_FUZZ_MODELS": "tiny",
                        "PYTHONPATH": str(REPO)}  # fmt: skip
    done = subprocess.run(
        [cli, "run", fuzz_gateway.base_url + "/openapi.json",
         "--checks", "not_a_server_error", "--max-response-time", "60",
         "--request-timeout", "60", "--max-examples", str(examples), "--max-time", str(seconds),
         "--exclude-path-regex", "^/admin/", "--seed", "7", "--workers", "1",  # one worker: Python 3.11's ast is not thread-safe
         "--suppress-health-check", "all", "--report-dir", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    summary = done.stdout[-12000:]
    (tmp_path / "schemathesis.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, summary + done.stderr[-2000:] + fuzz_gateway.log()[-3000:]
    assert "passed" in summary and "Server error" not in summary
    # The proof tier's time bound leaves no operation out. The fast tier's
    # 15 s may (on a loaded machine its coverage phase reached 8 of 15): it
    # checks what it ran.
    if seconds >= 150:
        assert re.search(r"Selected: (\d+)/\d+\s+Tested: \1\s", summary), summary
    assert fuzz_gateway.alive()
    assert httpx.get(fuzz_gateway.base_url + "/health", timeout=10).json() == {"status": "ok"}
    r = httpx.post(fuzz_gateway.api + "/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
