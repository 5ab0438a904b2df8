"""What the HTTP gateway costs on top of the engine it fronts.

Run (from the repo root):

    .venv/bin/python bench/gateway_overhead.py                       # tiny model, 1/4/16 streams
    .venv/bin/python bench/gateway_overhead.py --model-size medium --max-tokens 64 --repeats 3

It builds a random Qwen3.5 hybrid checkpoint into a temp dir, starts a real
`specgate serve` subprocess on a free 127.0.0.1 port (max_concurrent = 16, so
all streams batch), and in the same run drives two sides with the same chat
prompts (different per stream), greedy decoding and the same max_tokens:

  in-process  MLXPlainEngine on the same checkpoint, `async for ev in generate()`
  gateway     POST /v1/chat/completions, stream=true, return_token_ids=true, read
              by an httpx streaming client that parses the SSE `data:` lines

The phases never overlap (the machine has few cores), and in-process and gateway
phases alternate order from one repeat to the next. Both sides are warmed up
first. Both sides ignore EOS, so every stream generates exactly max_tokens
(counted from the returned token ids; the report says if one falls short).

Per concurrency level it reports the median over repeats of: aggregate tokens/s
(all tokens / wall time of the phase), per-stream time per token p50
((last token - first token) / (n - 1)), TTFT p50 and p95 (request start ->
first token, including chat-template rendering on both sides). Results also
go to --json (default bench/results/gateway_overhead.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_plain import MLXPlainEngine

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "bench-model"
SIZES = {
    "tiny": {},  # the demo size: hidden 128, 4 layers
    "medium": dict(
        hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
        num_attention_heads=8, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    ),
}
TOPICS = ["a lighthouse", "the moon", "a lost key", "bread", "rivers", "a clock", "snow",
          "a violin", "chess", "the desert", "bees", "a train", "glass", "maps", "salt", "owls"]
GREEDY = SamplingParams(temperature=0.0)
PLAN = Plan(engine="mlx_plain", method="none", depth=0, reason="no_drafter")


def messages(tag: str, i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"[{tag}.{i}] Write a long story about {topic}."}]


def stream_stats(t0: float, times: list[float], n_tokens: int) -> dict:
    """One stream: TTFT and time per token, in ms."""
    per_tok = (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else float("nan")
    return {"ttft_ms": (times[0] - t0) * 1e3, "ms_per_tok": per_tok, "tokens": n_tokens}


# -- the two sides -------------------------------------------------------------


async def inproc_stream(eng: MLXPlainEngine, msgs: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    prompt = await eng.render_chat(msgs)
    # No stop tokens: like the gateway side's ignore_eos, exactly max_tokens.
    req = GenerationRequest(f"bench-{id(msgs)}", MODEL_ID, prompt, GREEDY, max_tokens, PLAN)
    times, ids = [], []
    async for ev in eng.generate(req, None):
        if ev.token_ids:
            times.append(time.perf_counter())
            ids.extend(ev.token_ids)
    return stream_stats(t0, times, len(ids)) | {"ids": ids}


async def gateway_stream(client: httpx.AsyncClient, msgs: list[dict], max_tokens: int) -> dict:
    body = {"model": MODEL_ID, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    times, ids = [], []
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"gateway stream error: {obj['error']}")
            choices = obj.get("choices") or []
            if choices and choices[0].get("token_ids"):
                times.append(time.perf_counter())
                ids.extend(choices[0]["token_ids"])
    return stream_stats(t0, times, len(ids)) | {"ids": ids}


async def phase(make_stream, tag: str, streams: int, max_tokens: int) -> dict:
    """`streams` concurrent requests started together; summary of one phase."""
    t0 = time.perf_counter()
    per = await asyncio.gather(*(make_stream(messages(tag, i), max_tokens) for i in range(streams)))
    wall = time.perf_counter() - t0
    ttft = [s["ttft_ms"] for s in per]
    return {
        "tok_s": sum(s["tokens"] for s in per) / wall,
        "ms_per_tok_p50": float(np.nanpercentile([s["ms_per_tok"] for s in per], 50)),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p95": float(np.percentile(ttft, 95)),
        "tokens": [s["tokens"] for s in per],
        "ids": [s["ids"] for s in per],
    }


# -- the gateway subprocess ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gateway_server(ckpt: Path, workdir: Path, max_concurrent: int):
    """A `specgate serve` subprocess in its own process group; killed on exit."""
    port = free_port()
    cfg = workdir / "gateway.yaml"
    cfg.write_text(
        f"server:\n  host: 127.0.0.1\n  port: {port}\n  log_level: warning\n"
        f"models:\n  - id: {MODEL_ID}\n    path: {ckpt}\n"
        f"    max_concurrent: {max_concurrent}\n    max_queue: 64\n"
    )
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specgate", "serve", "--config", str(cfg)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited ({proc.returncode}):\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway not ready after 180 s:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue


# -- the run ---------------------------------------------------------------------


async def bench(args, ckpt: Path, url: str, max_concurrent: int) -> list[dict]:
    loaded = load_mlx_model(str(ckpt))
    eng = MLXPlainEngine(MODEL_ID, loaded, max_context=loaded.max_position_embeddings or 8192,
                         max_concurrent=max_concurrent, max_queue=64)
    await eng.start()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits)

    def sides(rep: int):
        both = [("inproc", lambda m, n: inproc_stream(eng, m, n)),
                ("gateway", lambda m, n: gateway_stream(client, m, n))]
        return both if rep % 2 == 0 else both[::-1]

    try:
        # Warm-up, excluded: one request, then a short batch at every width (MLX
        # builds kernels per shape), then the first connections of the client pool.
        for name, make in sides(0):
            await phase(make, "warm", 1, args.max_tokens)
            for c in args.concurrency:
                await phase(make, f"warm{c}", c, 4)
            print(f"warmed up {name}", flush=True)
        runs: dict[int, list[dict]] = {c: [] for c in args.concurrency}
        for rep in range(args.repeats):
            for c in args.concurrency:
                res = {}
                for name, make in sides(rep):
                    res[name] = await phase(make, f"r{rep}c{c}", c, args.max_tokens)
                runs[c].append(res)
                ip, gw = res["inproc"], res["gateway"]
                print(f"repeat {rep + 1}/{args.repeats} streams {c:>2}: tok/s in-proc "
                      f"{ip['tok_s']:.0f} gateway {gw['tok_s']:.0f}", flush=True)
    finally:
        await client.aclose()
        await eng.stop()
    return [summarize(c, runs[c], args.max_tokens) for c in args.concurrency]


def summarize(streams: int, runs: list[dict], max_tokens: int) -> dict:
    med = statistics.median
    out: dict = {"streams": streams, "repeats": len(runs)}
    for side in ("inproc", "gateway"):
        for key in ("tok_s", "ms_per_tok_p50", "ttft_p50", "ttft_p95"):
            out[f"{side}_{key}"] = med(r[side][key] for r in runs)
    out["ratio"] = out["gateway_tok_s"] / out["inproc_tok_s"]
    out["overhead_pct"] = (out["gateway_ms_per_tok_p50"] / out["inproc_ms_per_tok_p50"] - 1) * 100
    out["ttft_p50_delta_ms"] = out["gateway_ttft_p50"] - out["inproc_ttft_p50"]
    out["ttft_p95_delta_ms"] = out["gateway_ttft_p95"] - out["inproc_ttft_p95"]
    counts = [n for r in runs for side in ("inproc", "gateway") for n in r[side]["tokens"]]
    out["streams_short_of_max_tokens"] = sum(n < max_tokens for n in counts)
    out["token_ids_identical"] = sum(a == b for r in runs
                                     for a, b in zip(r["inproc"]["ids"], r["gateway"]["ids"], strict=True))
    out["streams_compared"] = sum(len(r["inproc"]["ids"]) for r in runs)
    out["per_repeat"] = [{side: {k: v for k, v in r[side].items() if k != "ids"}
                          for side in r} for r in runs]
    return out


def report(rows: list[dict]) -> None:
    head = ["streams", "in-proc tok/s", "gateway tok/s", "ratio", "in-proc ms/tok p50",
            "gateway ms/tok p50", "overhead %", "TTFT p50 in-proc", "TTFT p50 gateway", "+ms",
            "TTFT p95 in-proc", "TTFT p95 gateway", "+ms"]
    lines = [[str(r["streams"]), f"{r['inproc_tok_s']:.1f}", f"{r['gateway_tok_s']:.1f}",
              f"{r['ratio']:.3f}", f"{r['inproc_ms_per_tok_p50']:.3f}",
              f"{r['gateway_ms_per_tok_p50']:.3f}", f"{r['overhead_pct']:+.1f}",
              f"{r['inproc_ttft_p50']:.2f}", f"{r['gateway_ttft_p50']:.2f}",
              f"{r['ttft_p50_delta_ms']:+.2f}", f"{r['inproc_ttft_p95']:.2f}",
              f"{r['gateway_ttft_p95']:.2f}", f"{r['ttft_p95_delta_ms']:+.2f}"] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print(" | ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)))
    print("(TTFT in ms; ratio = gateway / in-proc tok/s; overhead = gateway / in-proc ms/tok - 1)")
    for r in rows:
        if r["streams_short_of_max_tokens"] or r["token_ids_identical"] != r["streams_compared"]:
            print(f"note: {r['streams']} streams: {r['streams_short_of_max_tokens']} stream(s) "
                  f"stopped before max_tokens (EOS); token ids identical in "
                  f"{r['token_ids_identical']}/{r['streams_compared']}")
    one = next((r for r in rows if r["streams"] == 1), None)
    if one is None:
        print("goal: overhead < 2% per token at 1 stream; TTFT p50 +< 1 ms: n/a (no 1-stream level)")
        return
    ok_tok, ok_ttft = one["overhead_pct"] < 2.0, one["ttft_p50_delta_ms"] < 1.0
    print(f"goal: overhead < 2% per token at 1 stream: {one['overhead_pct']:+.1f}% "
          f"{'PASS' if ok_tok else 'MISS'}")
    print(f"goal: TTFT p50 +< 1 ms at 1 stream: {one['ttft_p50_delta_ms']:+.2f} ms "
          f"{'PASS' if ok_ttft else 'MISS'}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=REPO / "bench/results/gateway_overhead.json")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    max_concurrent = max(16, *args.concurrency)

    # A SIGTERM unwinds like Ctrl-C, so the gateway subprocess is always killed.
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
        ckpt = build_qwen35_hybrid(Path(tmp) / "model", seed=0, **SIZES[args.model_size])
        with gateway_server(ckpt, Path(tmp), max_concurrent) as url:
            rows = asyncio.run(bench(args, ckpt, url, max_concurrent))
    print(f"\nmodel {args.model_size}, max_tokens {args.max_tokens}, greedy, "
          f"median of {args.repeats} repeats, {os.cpu_count()} CPUs")
    report(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model_size": args.model_size, "model_args": SIZES[args.model_size],
            "max_tokens": args.max_tokens, "repeats": args.repeats, "cpus": os.cpu_count()}
    args.json.write_text(json.dumps({"config": meta, "levels": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
