"""bench/gpu_suite.py, issue 44's one entry point, runs end to end on specgate's
core dependencies and exits 0; bench/serving.py reports a gateway that fails
to start with its log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

# The dev group's packages (pyproject.toml), and llguidance, which no section
# needs (no output is constrained): an import of any of them fails in the run.
NOT_CORE = ("pytest", "_pytest", "openai", "anthropic", "hypothesis", "schemathesis", "jsonschema_rs",
            "xdist", "ollama", "playwright", "ruff", "llguidance")  # fmt: skip
# Refuses NOT_CORE's imports, then runs the bench as `python bench/gpu_suite.py ARGS`.
RUN = """
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NOT_CORE:
            raise ImportError(name + " is not a core dependency of specgate")
sys.meta_path.insert(0, Refuse())
sys.argv = ["bench/gpu_suite.py", *sys.argv[1:]]
runpy.run_path("bench/gpu_suite.py", run_name="__main__")
"""


def suite(*args: str, home: Path, before: str = "") -> subprocess.CompletedProcess:
    """bench/gpu_suite.py ARGS in a fresh process, after `before` (code)."""
    env = {"PATH": "/usr/bin:/bin", "SPECGATE_HOME": str(home), "HOME": str(home)}
    code = f"NOT_CORE = {NOT_CORE!r}\n{before}\n{RUN}"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip


@pytest.mark.proof  # 30-80 s: the fast tier runs two sections in the next test
def test_the_tiny_suite_prints_every_section_exact_and_exits_0(tmp_path):
    raw = tmp_path / "suite.json"
    # Two speculative depths for the batch sections (each of batchengine's twice: run ahead, read
    # first), and batchengine's policy side (the gateway's plans over both engines).
    r = suite("--tiny", "--reps", "2", "--spec-depths", "1,3", "--sides", "ahead,first,policy",
              "--json", str(raw), home=tmp_path)  # fmt: skip
    out = r.stdout
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FAILED" not in out, out
    for title in ("## plain:", "## batched:", "## mtp:", "## batchspec:", "## batchengine:", "## ngram:"):
        assert title in out, out
    for row in ("decode tok/s", "prefill tok/s", "TTFT ms", "copy-heavy, ngram / generate_step",
                "prose under the policy: lowest single request"):  # fmt: skip
        assert row in out, out
    equal = [line for line in out.splitlines() if line.startswith("outputs token-for-token equal")]
    assert len(equal) == 6 and all(line.endswith("yes") for line in equal), equal
    assert " NO" not in "\n".join(equal)
    numbers = json.loads(raw.read_text())
    assert numbers["failed"] == {}
    assert len(numbers["plain"]["decode"]["ratio"]) == 2
    # Speculation inside the batch: every stream count and depth measured.
    assert set(numbers["batchspec"]["streams"]) == {"2", "4", "8"}
    assert len(numbers["batchspec"]["streams"]["2"]["d3 ratio"]) == 2
    # ... and through the served engines
    assert set(numbers["batchengine"]["streams"]) == {"2", "4", "8"}
    assert len(numbers["batchengine"]["streams"]["8"]["d1 ahead ratio"]) == 2
    assert len(numbers["batchengine"]["streams"]["8"]["d1 first ratio"]) == 2
    assert len(numbers["batchengine"]["streams"]["8"]["d3 policy ratio"]) == 2
    assert sum(numbers["batchengine"]["policy_methods"].values()) > 0


def test_a_failing_section_is_reported_and_the_run_goes_on_to_exit_0(tmp_path):
    # Failure injection (a fake): the transcripts cannot be read, so the
    # ngram section fails; the mtp section after it still runs.
    inject = ("import sys; sys.path.insert(0, 'bench'); import agent_workloads\n"
              "def unreadable(): raise OSError('injected: transcripts unreadable')\n"
              "agent_workloads.load_transcripts = unreadable\n")  # fmt: skip
    r = suite("--tiny", "--reps", "1", "--only", "ngram,mtp", home=tmp_path, before=inject)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "## ngram: FAILED (OSError: injected: transcripts unreadable)" in r.stdout
    assert "## mtp:" in r.stdout
    assert "sections that failed: ngram" in r.stdout


@pytest.mark.parametrize("args, says", [
    (["--only", "plain,nonsense"], "unknown section(s) nonsense"),
    (["--tokens", "1"], "--tokens >= 2"),
    (["--streams", "4,x"], "comma-separated integers"),
    (["--sides", "ahead,sideways"], "--sides takes ahead, first and policy"),
])  # fmt: skip
def test_bad_arguments_exit_2(tmp_path, args, says):
    r = suite(*args, home=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr


def test_a_gateway_that_fails_to_start_is_reported_with_its_log(tmp_path):
    from serving import GatewayFailed, serving

    with pytest.raises(GatewayFailed) as failed:
        with serving([{"id": "m", "path": str(tmp_path / "no-such-model")}], tmp_path, timeout=60):
            pass
    message = str(failed.value)
    assert "gateway exited with" in message
    assert "no-such-model" in message  # the config error, from the gateway's own log


def test_cold_start_runs_fresh_processes_and_prints_its_table(tmp_path):
    """bench/cold_start.py: a fresh mode a process of its own on fresh
    caches, a restart on its; on a CPU no kernel builds, so the
    speculative token comes on the stock verify, equal to the plain
    engine's tokens. (Serial differs from parallel only where a builder
    exists: on CUDA.)"""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "bench/cold_start.py", "--tiny", "--modes", "parallel,restart",
                        "--deadline", "60", "--json", str(tmp_path / "out.json")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = json.loads((tmp_path / "out.json").read_text())
    for mode in ("parallel", "restart"):
        (run,) = runs[mode]
        assert run["exact"] is True and run["first speculative token"] > 0 and run["first plain token"] > 0
        assert run["machine key"].startswith("cpu-")
    assert "| parallel |" in r.stdout and "verdicts against the first run's" in r.stdout
    assert list(tmp_path.glob("cold-start-*")) == []  # its fresh homes removed
