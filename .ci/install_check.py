"""specgate installs beside the packages a user already has, both ways.

The wheel (pip-style install into a fresh venv) and the project's editable
install (`uv sync`, into a venv of its own), each together with
transformers 5.25 and Hugging Face's `kernels` (a top-level package name
specgate once shipped too). In each venv:

- `specgate serve` (the demo model) answers a chat completion;
- `import kernels; kernels.get_kernel` still works: specgate wrote nothing
  into another distribution's folder;
- after `uv pip uninstall kernels`, specgate still serves.

The wheel must also hold one top-level import package, `specgate`.
Run by .ci/run (it downloads from the package index, so it is a CI step and
not a test). Usage: python3 .ci/install_check.py [uv command...]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UV = sys.argv[1:] or ["uv"]
BESIDE = ["transformers==5.25.*", "kernels"]  # what a user may already have


def sh(*args, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, args)), flush=True)
    return subprocess.run(list(map(str, args)), check=True, timeout=1200, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serves(venv: Path, home: Path, label: str) -> None:
    """`specgate serve` from this venv answers a chat completion on loopback."""
    port = free_port()
    env = {**os.environ, "SPECGATE_HOME": str(home), "PYTHONPATH": ""}
    log = home / f"serve-{label}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([venv / "bin" / "specgate", "serve", "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=home, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        # Greedy, and past an end-of-text: the demo model is tiny, and a sampled
        # first token was once its end of text (0 tokens served, a false alarm).
        body = json.dumps({"model": "specgate-demo", "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True,
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{label}: specgate serve exited ({proc.returncode}):\n"
                                 + log.read_text()[-4000:])  # fmt: skip
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as r:
                    pass
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions", body,
                    {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=120) as r:
                    reply = json.load(r)
                break
            except urllib.error.HTTPError as e:  # not ready: loading, or failed for good
                if "failed" in json.loads(e.read() or b"{}").get("models", {}).values():
                    raise SystemExit(f"{label}: the model failed to load:\n"
                                     + log.read_text()[-4000:]) from None
                time.sleep(1)
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{label}: no answer in 600 s:\n" + log.read_text()[-4000:]) from None
                time.sleep(1)
        text = reply["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] == 8, reply  # max_tokens, past any end of text
        print(f"{label}: served {reply['usage']['completion_tokens']} tokens: {text!r}", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# Every file specgate's distribution installed belongs to it alone (whatever
# the install order, two distributions writing one path overwrite each other,
# and uninstalling either deletes the other's file); Hugging Face's kernels
# imports as itself.
_SHARED = """
import importlib.metadata as md, kernels, specgate.kernels.guard
kernels.get_kernel
ours = {str(f) for f in md.distribution("specgate-llm").files if not str(f).startswith("..")}
shared = {d.metadata["Name"]: sorted(ours & {str(f) for f in (d.files or [])})
          for d in md.distributions() if d.metadata["Name"] != "specgate-llm"}
shared = {k: v[:5] for k, v in shared.items() if v}
assert not shared, f"files specgate shares with other distributions: {shared}"
print("kernels:", kernels.__file__)
"""


def hf_kernels_works(venv: Path, home: Path) -> None:
    sh(venv / "bin" / "python", "-c", _SHARED, cwd=home, env={**os.environ, "PYTHONPATH": ""})


def check(venv: Path, home: Path, label: str) -> None:
    sh(*UV, "pip", "install", "--python", venv / "bin" / "python", *BESIDE)
    hf_kernels_works(venv, home)
    serves(venv, home, label)
    sh(*UV, "pip", "uninstall", "--python", venv / "bin" / "python", "kernels")
    serves(venv, home, f"{label}, kernels uninstalled")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="specgate-install-"))
    try:
        home = work / "home"
        home.mkdir()
        dist = work / "dist"
        sh(*UV, "build", "--wheel", "--out-dir", dist, REPO)
        (wheel,) = dist.glob("*.whl")
        tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()
                if not n.split("/")[0].endswith(".dist-info")}  # fmt: skip
        assert tops == {"specgate"}, f"the wheel installs top-level {sorted(tops)}, not only specgate"

        wheel_venv = work / "wheel-venv"
        sh(*UV, "venv", "--quiet", "--python", f"{sys.version_info[0]}.{sys.version_info[1]}",
           wheel_venv)
        sh(*UV, "pip", "install", "--python", wheel_venv / "bin" / "python", wheel)
        check(wheel_venv, home, "wheel")

        editable_venv = work / "editable-venv"
        sh(*UV, "sync", "--frozen", "--no-dev", cwd=REPO,
           env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(editable_venv)})
        check(editable_venv, home, "uv sync (editable)")
        print("install check: both installs serve beside transformers 5.25 and kernels", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
