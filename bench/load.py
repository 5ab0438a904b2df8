"""Many clients at once: does every request get a full answer or a 429?

    uv run python bench/load.py [--clients 200] [--seconds 60] [--max-tokens 32]

Starts a real `specgate serve` on a loopback port serving the demo model
(mlx_plain + mlx_mtp, the policy deciding) and runs --clients streaming chat
clients for --seconds. Each client loops: send a request, read the stream to
its end, and on a 429 sleep for the Retry-After it was given, then go on.
Every request ends in exactly one of:

- full: the stream ended with a finish_reason and `data: [DONE]`, or
- refused: 429 with a Retry-After header, or
- lost: anything else (5xx, a stream cut short, no Retry-After, a client
  timeout); the goal is none.

Reported: counts, aggregate generated tokens/s, p50/p99 of request latency
and time to first token of full answers, and the server's resident memory
(sampled each second with `ps`, so it works on macOS too) at the start and
at its peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from serving import REPO, serving

PROMPTS = ["Write a function that parses a date.", "def fib(n):", "class Queue:",
           "Explain what a context manager does.", "import os\n\ndef walk(root):"]  # fmt: skip


def rss_mib(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 1024


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 429:
                retry = r.headers.get("retry-after")
                return {"outcome": "refused" if retry else "lost", "retry": float(retry or 1)}
            if r.status_code != 200:
                return {"outcome": "lost", "why": f"status {r.status_code}"}
            ttft, finish, done, tokens = None, None, False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if ttft is None and choice["delta"].get("content"):
                        ttft = time.perf_counter() - t0
                    finish = choice.get("finish_reason") or finish
            if not (done and finish):
                return {"outcome": "lost", "why": "stream ended early"}
            return {"outcome": "full", "latency": time.perf_counter() - t0,
                    "ttft": ttft if ttft is not None else time.perf_counter() - t0,
                    "tokens": tokens}  # fmt: skip
    except httpx.HTTPError as e:
        return {"outcome": "lost", "why": type(e).__name__}


async def drive(url: str, clients: int, seconds: float, max_tokens: int) -> list[dict]:
    results: list[dict] = []
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=30),
                                 limits=limits, trust_env=False) as client:  # fmt: skip
        async def client_loop(i: int):
            n = 0
            while time.perf_counter() < deadline:
                res = await one_request(client, PROMPTS[(i + n) % len(PROMPTS)], max_tokens)
                results.append(res)
                n += 1
                if res["outcome"] == "refused":
                    await asyncio.sleep(min(res["retry"], max(0.0, deadline - time.perf_counter())))
        await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return results


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (
        values[0] if values else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-concurrent", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/load.json")
    args = ap.parse_args()
    model = {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"],
             "max_concurrent": args.max_concurrent, "max_queue": args.max_queue}
    with (tempfile.TemporaryDirectory() as tmp,
          serving([model], Path(tmp), Path(tmp) / "home") as (url, proc)):
        memory = [rss_mib(proc.pid)]

        async def sampled():
            task = asyncio.ensure_future(drive(url, args.clients, args.seconds, args.max_tokens))
            while not task.done():
                await asyncio.sleep(1)
                memory.append(rss_mib(proc.pid))
            return await task
        t0 = time.perf_counter()
        results = asyncio.run(sampled())
        wall = time.perf_counter() - t0
        healthy = httpx.get(url + "/health", timeout=5).status_code == 200
    report(results, wall, memory, healthy, args)


def report(results: list[dict], wall: float, memory: list[float], healthy: bool, args) -> None:
    outcomes = Counter(r["outcome"] for r in results)
    full = [r for r in results if r["outcome"] == "full"]
    lat, ttft = [r["latency"] for r in full], [r["ttft"] for r in full]
    tokens = sum(r["tokens"] for r in full)
    why = Counter(r.get("why") for r in results if r["outcome"] == "lost")
    row = {"clients": args.clients, "seconds": round(wall, 1), "requests": len(results),
           "full": outcomes["full"], "refused_429": outcomes["refused"], "lost": outcomes["lost"],
           "tokens_per_s": round(tokens / wall, 1),
           "latency_p50_s": round(pct(lat, 50), 2), "latency_p99_s": round(pct(lat, 99), 2),
           "ttft_p50_s": round(pct(ttft, 50), 2), "ttft_p99_s": round(pct(ttft, 99), 2),
           "rss_start_mib": round(memory[0]), "rss_peak_mib": round(max(memory)),
           "health_after": healthy}  # fmt: skip
    print(f"\ndemo model, {args.clients} streaming clients for {args.seconds:.0f} s, "
          f"max_tokens {args.max_tokens}, max_concurrent {args.max_concurrent}, "
          f"max_queue {args.max_queue}")
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if why:
        print("lost:", dict(why))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
