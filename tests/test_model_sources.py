"""Models from where users keep them (engines/checkpoints/sources.py):
`specgate pull` from a Hugging Face mirror, Ollama's store, LM Studio's
folder, GGUF repos in the hub cache; all on loopback, on the real SmolLM2.

The mirror is a real HTTP server (http.server, in this file) answering the
hub endpoints huggingface_hub's snapshot_download calls: repo info, the
recursive tree, HEAD and ranged GET of `resolve/`. It is a fake of the hub
by necessity (nothing here reaches the internet); its one injected fault
drops the connection halfway through the GGUF, once, to show the resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from conftest import REPO, start_gateway, stop_gateway

from specgate.engines.checkpoints.inspect import UsageError, resolve_local
from specgate.engines.checkpoints.sources import SourceError, resolve_source

COMMIT = "a" * 40
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------- the mirror


class Mirror(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, Path]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.drop_once: set[str] = set()  # "repo/file" whose first full GET is cut halfway
        self.down: set[str] = set()  # "repo/file" answered 500 to ranged GETs: a hub gone down
        self.sha256 = {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
                       for files in repos.values() for p in files.values()}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Mirror
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _missing(self, code: str) -> None:  # huggingface_hub reads X-Error-Code
        self._send(404, b"{}", {"X-Error-Code": code, "Content-Type": "application/json"})

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = unquote(urlsplit(self.path).path)
        self.server.requests.append((self.command, path, self.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, what = "/".join(parts[2:4]), parts[4]
            if repo not in self.server.repos:
                return self._missing("RepoNotFound")
            files = self.server.repos[repo]
            if what == "revision":
                return self._json({"id": repo, "sha": COMMIT,
                                   "siblings": [{"rfilename": f} for f in files]})
            if what == "tree":
                return self._json([self._entry(name, p) for name, p in files.items()])
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if repo not in self.server.repos:
                return self._missing("RepoNotFound")
            if name not in self.server.repos[repo]:
                return self._missing("EntryNotFound")
            return self._file(f"{repo}/{name}", self.server.repos[repo][name])
        self._missing("RepoNotFound")

    def _entry(self, name: str, p: Path) -> dict:
        size = p.stat().st_size
        return {"type": "file", "path": name, "size": size, "oid": hashlib.sha1(name.encode()).hexdigest(),
                "lfs": {"oid": self.server.sha256[str(p)], "size": size, "pointerSize": 134}}

    def _file(self, key: str, p: Path) -> None:
        size, start = p.stat().st_size, 0
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self.server.sha256[str(p)]}"',
                   "Accept-Ranges": "bytes"}
        status = 200
        if key in self.server.down and self.headers.get("Range"):
            return self._send(500, b"{}")
        if (rng := self.headers.get("Range")) and self.command == "GET":
            start = int(rng.removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
            status = 206
        self.send_response(status)
        for k, v in {"Content-Length": str(size - start), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = None
        if key in self.server.drop_once and start == 0:  # the injected fault
            self.server.drop_once.discard(key)
            cut = size // 2
        with open(p, "rb") as f:
            f.seek(start)
            sent = start
            while chunk := f.read(1 << 20):
                if cut is not None and sent + len(chunk) > cut:
                    self.wfile.write(chunk[: cut - sent])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)  # mid-body: the client must resume
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                sent += len(chunk)


@pytest.fixture(scope="module")
def mirror(smollm2_gguf, tmp_path_factory):
    src = tmp_path_factory.mktemp("mirror-src")
    readme = src / "README.md"
    readme.write_text("---\nlicense: apache-2.0\n---\nSmolLM2-135M-Instruct, GGUF\n")
    other_quant = src / "q8"  # listed, never downloaded: its bytes do not matter
    other_quant.write_bytes(b"GGUF" + bytes(60))
    safetensors = {name: src / name.replace("/", "_") for name in
                   ("config.json", "model.safetensors", "tokenizer.json", "pytorch_model.bin",
                    "original/consolidated.00.pth")}
    for name, p in safetensors.items():
        p.write_text("{}" if name.endswith(".json") else name)
    server = Mirror({
        "org/smol": {"README.md": readme, SMOL: smollm2_gguf,
                     "SmolLM2-135M-Instruct.Q8_0.gguf": other_quant},
        "org/safe": safetensors,
    })
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _pull(mirror: Mirror, hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(hf_home), "HF_ENDPOINT": mirror.url, "HF_HUB_DISABLE_XET": "1"}
    return subprocess.run([sys.executable, "-m", "specgate", "pull", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pulled(mirror, tmp_path_factory):
    """`specgate pull org/smol:Q4_1` into a fresh HF_HOME, its connection
    dropped once halfway through the GGUF."""
    hf_home = tmp_path_factory.mktemp("hf-home")
    mirror.drop_once.add(f"org/smol/{SMOL}")
    start = len(mirror.requests)
    proc = _pull(mirror, hf_home, "org/smol:Q4_1")
    return hf_home, proc, mirror.requests[start:]


def test_pull_downloads_one_quant_and_resumes_a_dropped_connection(pulled, smollm2_gguf):
    hf_home, proc, requests = pulled
    assert proc.returncode == 0, proc.stderr
    snapshot = hf_home / "hub" / "models--org--smol" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == [SMOL]  # not Q8_0, not the README
    assert (snapshot / SMOL).read_bytes() == smollm2_gguf.read_bytes()
    gets = [r for r in requests if r[0] == "GET" and r[1].endswith(SMOL)]
    half = smollm2_gguf.stat().st_size // 2
    # The first GET was cut at half; the next asked only for what the client
    # had not written yet (it writes whole chunks: up to half).
    assert [g[2] is None for g in gets] == [True, False], gets
    assert 0 < int(gets[1][2].removeprefix("bytes=").rstrip("-")) <= half, gets
    assert 'path: "org/smol:Q4_1", engines: [llamacpp]' in proc.stdout
    assert "100%" in proc.stderr  # plain progress lines: stderr is no TTY here


def test_a_failed_pull_says_so_and_leaves_nothing_to_serve(mirror, tmp_path, smollm2_gguf,
                                                            monkeypatch):
    """huggingface_hub (2.x) resumes within a run only: a run that gives up
    discards its partial file (huggingface_hub PR 4228). What must hold: the
    failure is said, and no half file is ever served."""
    key = f"org/smol/{SMOL}"
    mirror.drop_once.add(key)
    mirror.down.add(key)  # the resume fails too: this run gives up
    try:
        failed = _pull(mirror, tmp_path, "org/smol:Q4_1")
    finally:
        mirror.down.discard(key)
    assert failed.returncode == 1 and "download failed" in failed.stderr, failed.stderr
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(SourceError, match="org/smol .* has no Q4_1 GGUF; it has: none"):
        resolve_source("org/smol:Q4_1")
    again = _pull(mirror, tmp_path, "org/smol:Q4_1")
    assert again.returncode == 0, again.stderr
    assert resolve_source("org/smol:Q4_1").read_bytes() == smollm2_gguf.read_bytes()


def test_pull_picks_what_specgate_serves(mirror, tmp_path):
    proc = _pull(mirror, tmp_path, "org/safe")
    assert proc.returncode == 0, proc.stderr
    snapshot = tmp_path / "hub" / "models--org--safe" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors",
                                                          "tokenizer.json"]
    assert 'path: "org/safe", engines: [mlx_plain]' in proc.stdout
    proc = _pull(mirror, tmp_path / "b", "org/safe", "--include", "*.bin")
    assert proc.returncode == 0, proc.stderr
    snapshot = tmp_path / "b" / "hub" / "models--org--safe" / "snapshots" / COMMIT
    assert [p.name for p in snapshot.iterdir()] == ["pytorch_model.bin"]


@pytest.mark.parametrize("spec,needles", [
    ("org/smol", ["several GGUF models", SMOL, "org/smol:Q4_1 or org/smol:Q8_0"]),
    ("org/smol:Q9_9", ["has no Q9_9 GGUF", "org/smol:Q4_1"]),
    ("org/nothing", ["org/nothing: no such repo"]),
    ("not a repo", ["expected ORG/NAME"]),
])
def test_pull_errors(mirror, tmp_path, spec, needles):
    proc = _pull(mirror, tmp_path, spec)
    assert proc.returncode == 1
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not (tmp_path / "hub" / "models--org--smol" / "snapshots").exists()


# ---------------------------------------------------------------- Ollama's store


def _ollama_store(root: Path, blob_source: Path, name: str = "smollm2", tag: str = "135m",
                  layers: list[dict] | None = None, namespace: str = "library") -> Path:
    digest = "sha256:" + "b" * 64
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.exists():
        blob.symlink_to(blob_source)  # the real GGUF, under Ollama's content-addressed name
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = layers if layers is not None else [
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "c" * 64}]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


def test_ollama_names_resolve_to_their_blob(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    blob = _ollama_store(tmp_path, smollm2_gguf)
    _ollama_store(tmp_path, smollm2_gguf, name="smol", tag="latest", namespace="someone")
    assert resolve_source("ollama:smollm2:135m") == blob
    assert resolve_source("ollama:someone/smol") == blob  # tag latest
    assert resolve_source("ollama:registry.ollama.ai/library/smollm2:135m") == blob
    # The blob has no .gguf suffix: its magic makes it a GGUF, for inspect and the config.
    assert resolve_local("ollama:smollm2:135m") == blob
    from specgate.engines.checkpoints.reader import read_checkpoint
    from specgate.gateway.config import parse_config

    assert read_checkpoint(blob).format == "gguf"
    models = parse_config({"models": [{"id": "s", "path": "ollama:smollm2:135m"},
                                      {"id": "b", "path": str(blob)}]}).models
    assert [(m.is_gguf, m.engines) for m in models] == [(True, ["llamacpp"])] * 2


def test_ollama_errors_say_what_is_there(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    with pytest.raises(SourceError, match=r"no Ollama model store found \(looked in .*none\); set OLLAMA_MODELS"):
        resolve_source("ollama:smollm2")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    _ollama_store(tmp_path, smollm2_gguf, tag="135m")
    _ollama_store(tmp_path, smollm2_gguf, tag="360m")
    with pytest.raises(SourceError, match="smollm2 has no tag latest in .*; its tags: 135m, 360m"):
        resolve_source("ollama:smollm2")
    with pytest.raises(SourceError, match="no model qwen3 in"):
        resolve_source("ollama:qwen3:4b")
    _ollama_store(tmp_path, smollm2_gguf, name="embed", tag="latest", layers=[
        {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "d" * 64}])
    with pytest.raises(SourceError, match="has no model layer"):
        resolve_source("ollama:embed")
    _ollama_store(tmp_path, smollm2_gguf, name="gone", tag="latest", layers=[
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "e" * 64}])
    with pytest.raises(SourceError, match="model blob .*sha256-eee.* is missing"):
        resolve_source("ollama:gone")
    # The same messages at config validation, on the model's path.
    from specgate.gateway.config import ConfigError, load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {id: a, path: 'ollama:smollm2:7b'}\n")
    with pytest.raises(ConfigError, match=r"models\.0\.path: .*its tags: 135m, 360m"):
        load_config(cfg)


# ---------------------------------------------------------------- LM Studio


def test_lmstudio_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "none"))
    with pytest.raises(SourceError, match="no LM Studio models folder found .* set LMSTUDIO_MODELS"):
        resolve_source("lmstudio:org/repo")
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path))
    gguf_repo = tmp_path / "lmstudio-community" / "SmolLM2-GGUF"
    gguf_repo.mkdir(parents=True)
    for name in ("SmolLM2-Q4_K_M.gguf", "SmolLM2-Q8_0.gguf", "mmproj-SmolLM2-F16.gguf"):
        (gguf_repo / name).write_bytes(b"GGUF" + bytes(28))
    with pytest.raises(SourceError, match="several GGUF models .* lmstudio:lmstudio-community/"
                                          "SmolLM2-GGUF:Q4_K_M or .*:Q8_0"):
        resolve_source("lmstudio:lmstudio-community/SmolLM2-GGUF")
    assert resolve_source("lmstudio:lmstudio-community/SmolLM2-GGUF:q8_0") == gguf_repo / "SmolLM2-Q8_0.gguf"
    assert (resolve_source("lmstudio:lmstudio-community/SmolLM2-GGUF/SmolLM2-Q4_K_M.gguf")
            == gguf_repo / "SmolLM2-Q4_K_M.gguf")
    with pytest.raises(SourceError, match="has no Q4_K GGUF"):  # Q4_K is not Q4_K_M
        resolve_source("lmstudio:lmstudio-community/SmolLM2-GGUF:Q4_K")
    mlx_repo = tmp_path / "mlx-community" / "SmolLM2-4bit"
    mlx_repo.mkdir(parents=True)
    (mlx_repo / "config.json").write_text("{}")
    (mlx_repo / "model.safetensors").write_bytes(b"")
    assert resolve_source("lmstudio:mlx-community/SmolLM2-4bit") == mlx_repo
    (tmp_path / "x" / "empty").mkdir(parents=True)
    with pytest.raises(SourceError, match="neither a GGUF file nor an MLX model"):
        resolve_source("lmstudio:x/empty")
    with pytest.raises(SourceError, match="no x/nope in .*; there: lmstudio-community/SmolLM2-GGUF"):
        resolve_source("lmstudio:x/nope")
    from specgate.gateway.config import parse_config

    models = parse_config({"models": [
        {"id": "g", "path": "lmstudio:lmstudio-community/SmolLM2-GGUF:Q8_0"},
        {"id": "m", "path": "lmstudio:mlx-community/SmolLM2-4bit"}]}).models
    assert [m.engines for m in models] == [["llamacpp"], ["mlx_plain"]]


# ---------------------------------------------------------------- the hub cache


def test_gguf_repos_in_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "hub" / "models--org--x-GGUF"
    snap = repo / "snapshots" / COMMIT
    (snap / "big").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snap / "x-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(28))
    assert resolve_source("org/x-GGUF") == snap / "x-Q4_K_M.gguf"  # the one GGUF
    for shard in ("x-Q8_0-00001-of-00002.gguf", "x-Q8_0-00002-of-00002.gguf"):
        (snap / "big" / shard).write_bytes(b"GGUF" + bytes(28))
    with pytest.raises(SourceError, match="several GGUF models .*org/x-GGUF:Q4_K_M or org/x-GGUF:Q8_0"):
        resolve_source("org/x-GGUF")
    assert resolve_source("org/x-GGUF:Q8_0") == snap / "big" / "x-Q8_0-00001-of-00002.gguf"
    with pytest.raises(SourceError, match="org/y is not in the local Hugging Face cache .*specgate pull org/y:Q4_0"):
        resolve_source("org/y:Q4_0")
    with pytest.raises(UsageError, match="specgate pull org/y:Q4_0"):
        resolve_local("org/y:Q4_0")


# ---------------------------------------------------------------- serving them


def test_pulled_and_ollama_models_serve(pulled, smollm2_gguf, llama_server_binary, tmp_path,
                                        monkeypatch):
    hf_home, proc, _ = pulled
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    _ollama_store(tmp_path / "ollama", smollm2_gguf)
    # --no-repack: ggml's AMX repack of Q4_1 crashes on this CPU (issue 42).
    # One thread each: two spin at each op's barrier, and beside the other
    # process and the MLX model's load a first reply took 15 s of a 2-core box.
    llamacpp = {"extra_args": ["--no-repack"], "threads": 1}
    config = {"llama_server": {"binary": str(llama_server_binary)}, "models": [
        {"id": id_, "path": path, "max_context": 1024, "max_concurrent": 1, "llamacpp": llamacpp}
        for id_, path in (("pulled", "org/smol:Q4_1"), ("ollama", "ollama:smollm2:135m"))]}
    # The Ollama blob (no .gguf suffix) under an MLX engine: imported by its magic.
    config["models"].append({"id": "ollama-mlx", "path": "ollama:smollm2:135m",
                             "engines": ["mlx_plain"], "max_context": 1024})
    gw = start_gateway(config, tmp_path, timeout=300)
    try:
        texts = []
        for model in ("pulled", "ollama"):
            r = httpx.post(gw.base_url + "/v1/chat/completions", timeout=120, json={
                "model": model, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        # One GGUF reached two ways: the same greedy reply (whether it says
        # Paris is the llama.cpp route's business, not the resolver's).
        assert texts[0] and texts[0] == texts[1], texts
        r = httpx.post(gw.base_url + "/v1/chat/completions", timeout=300, json={
            "model": "ollama-mlx", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        listed = httpx.get(gw.base_url + "/v1/models", timeout=10).json()["data"]
        assert sorted(m["id"] for m in listed) == ["ollama", "ollama-mlx", "pulled"]
    finally:
        stop_gateway(gw)
