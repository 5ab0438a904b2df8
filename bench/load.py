"""Many clients at once, quiet and hostile: does every request get a full answer or a 429?

    uv run python bench/load.py [--clients 200] [--seconds 60] [--max-tokens 32]
                                [--impatient 20] [--wrong-key 10] [--bombs 10]
                                [--idle 2000] [--slow-body 5] [--runs 1]

Starts a real `specgate serve` on a loopback port serving the demo model
(mlx_plain + mlx_mtp, the policy deciding), with API keys, and runs two
mixes against it one after the other (alternating, --runs times each):

- quiet: --clients well-behaved streaming chat clients for --seconds. Each
  loops: send a request, read the stream to its end, and on a 429 sleep for
  the Retry-After it was given, then go on. They use ten keys, as a team would.
- hostile: the same clients, plus --impatient clients that send a long
  prompt (a few thousand tokens) and hang up after 1-3 s, mid-prefill (as
  an agent that gives up does; on a 429 they wait its Retry-After, as the
  SDKs do), --wrong-key clients that send a known key id with a wrong
  secret as fast as they are answered (ignoring Retry-After, as an attacker
  would), --bombs clients sending grammar bombs (a `$ref` chain that once
  overflowed the compiler's stack, 10,000 properties, 5,000 anyOf
  branches) in a loop, --idle sockets held open sending nothing (reopened
  as soon as the server closes one), and --slow-body clients trickling a
  body a byte a second. The hostile clients come from other loopback
  addresses (127.0.0.2 and up) than the well-behaved ones (127.0.0.1), as
  other machines on the LAN would.

A well-behaved request ends in exactly one of:
- full: the stream ended with a finish_reason and `data: [DONE]`, or
- refused: 429 with a Retry-After header, or
- lost: anything else (5xx, a stream cut short, no Retry-After, a client
  timeout); the goal is none.

Reported per run: well-behaved full / 429 / lost, p50/p99 of their request
latency and time to first token, with the hostile run's p50 as a ratio of
the quiet run's (goal: within 1.5x); what the hostile clients got; whether
/health answered throughout (polled every 0.5 s, slowest answer); and the
server's resident memory at its peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from serving import REPO, serving

from specgate.gateway.access.keys import add_key, split_key

PROMPTS = ["Write a function that parses a date.", "def fib(n):", "class Queue:",
           "Explain what a context manager does.", "import os\n\ndef walk(root):"]  # fmt: skip
TEAM_KEYS = 10
LONG_PROMPT_TOKENS = 3000


def rss_mib(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 1024


async def one_request(client: httpx.AsyncClient, key: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
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


async def impatient_request(client: httpx.AsyncClient, key: str,
                            rng: random.Random) -> tuple[str, float]:  # fmt: skip
    """A long prompt, abandoned after 1-3 s (before its first token, mostly):
    what happened, and how long to wait before the next (a 429's Retry-After)."""
    prompt = [rng.randrange(10, 4000) for _ in range(LONG_PROMPT_TOKENS)]
    body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "stream": True}
    try:
        async with asyncio.timeout(rng.uniform(1, 3)):
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}", float(r.headers.get("retry-after", 0))
                async for _ in r.aiter_bytes():
                    pass
                return "finished", 0.0
    except TimeoutError:
        return "abandoned", 0.0
    except httpx.HTTPError as e:
        return type(e).__name__, 0.0


async def wrong_key_request(client: httpx.AsyncClient, key: str) -> str:
    key_id, _ = split_key(key)
    try:
        r = await client.post("/v1/chat/completions", headers={
            "Authorization": f"Bearer sg-{key_id}.{random.getrandbits(128):032x}"},
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
        return str(r.status_code)
    except httpx.HTTPError as e:
        return type(e).__name__


def bomb_body(i: int) -> dict:
    if i % 3 == 0:  # a $ref chain 999 objects deep (killed the process once)
        defs = {f"d{j}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{j + 1}"}}}
                for j in range(999)}  # fmt: skip
        schema = {"$defs": defs | {"d999": {"type": "string"}}, "$ref": "#/$defs/d0"}
    elif i % 3 == 1:
        schema = {"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(10_000)}}
    else:
        schema = {"anyOf": [{"const": f"v{j}"} for j in range(5000)]}
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": True, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "o", "schema": schema}}}  # fmt: skip


async def idle_socket(host: str, port: int, local: str, deadline: float, counts: Counter) -> None:
    """Hold a connection open sending nothing; when the server closes it, open another."""
    while time.perf_counter() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(local, 0))
        except OSError as e:
            counts[f"connect {type(e).__name__}"] += 1
            await asyncio.sleep(1)
            continue
        counts["opened"] += 1
        try:
            async with asyncio.timeout(max(0.0, deadline - time.perf_counter())):
                await reader.read()  # b"" once the server closes it
            counts["closed by server"] += 1
        except TimeoutError:
            pass
        finally:
            writer.close()


async def slow_body(host: str, port: int, local: str, key: str) -> str:
    """Headers promising 100 kB, then a byte a second until the server answers."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(local, 0))
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
                     "content-type: application/json\r\ncontent-length: 100000\r\n\r\n{".encode())  # fmt: skip
        while True:
            try:
                head = await asyncio.wait_for(reader.read(64), 1.0)
                return head.split(b"\r\n")[0].decode(errors="replace")[9:12] or "closed"
            except TimeoutError:
                writer.write(b" ")
                await writer.drain()
    except OSError as e:
        return type(e).__name__
    finally:
        writer.close()


async def drive(url: str, keys: dict[str, str], args, hostile: bool) -> dict:
    results: list[dict] = []
    impatient: Counter = Counter()
    wrong: Counter = Counter()
    bombs: Counter = Counter()
    idle: Counter = Counter()
    slow: Counter = Counter()
    host, port = httpx.URL(url).host, httpx.URL(url).port
    health: list[float | None] = []
    deadline = time.perf_counter() + args.seconds
    n_conn = args.clients + args.impatient + args.wrong_key + 16
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    # The hostile clients from another address than the team's.
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.2", limits=limits)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=30),
                                 limits=limits, trust_env=False) as client, \
            httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=30),
                              transport=other, trust_env=False) as stranger:  # fmt: skip
        async def client_loop(i: int):
            n, key = 0, keys[f"team-{i % TEAM_KEYS}"]
            while time.perf_counter() < deadline:
                res = await one_request(client, key, PROMPTS[(i + n) % len(PROMPTS)],
                                        args.max_tokens)  # fmt: skip
                results.append(res)
                n += 1
                if res["outcome"] == "refused":
                    await asyncio.sleep(min(res["retry"], max(0.0, deadline - time.perf_counter())))

        async def impatient_loop(i: int):
            rng = random.Random(i)
            while time.perf_counter() < deadline:
                outcome, retry = await impatient_request(stranger, keys["impatient"], rng)
                impatient[outcome] += 1
                await asyncio.sleep(min(retry, max(0.0, deadline - time.perf_counter())))

        async def wrong_key_loop():
            while time.perf_counter() < deadline:
                wrong[await wrong_key_request(stranger, keys["team-0"])] += 1
                await asyncio.sleep(0.05)

        async def bomb_loop(i: int):
            while time.perf_counter() < deadline:
                try:
                    r = await stranger.post("/v1/chat/completions", json=bomb_body(i),
                                            headers={"Authorization": f"Bearer {keys['impatient']}"})  # fmt: skip
                    bombs[str(r.status_code)] += 1
                except httpx.HTTPError as e:
                    bombs[type(e).__name__] += 1
                i += 1
                await asyncio.sleep(0.1)

        async def slow_loop(i: int):
            while time.perf_counter() < deadline:
                slow[await slow_body(host, port, f"127.0.0.{3 + i}", keys["impatient"])] += 1

        async def health_loop():
            async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as probe:
                while time.perf_counter() < deadline:
                    t0 = time.perf_counter()
                    try:
                        ok = (await probe.get("/health")).status_code == 200
                        health.append(time.perf_counter() - t0 if ok else None)
                    except httpx.HTTPError:
                        health.append(None)
                    await asyncio.sleep(0.5)

        tasks = [client_loop(i) for i in range(args.clients)] + [health_loop()]
        if hostile:
            tasks += [impatient_loop(i) for i in range(args.impatient)]
            tasks += [wrong_key_loop() for _ in range(args.wrong_key)]
            tasks += [bomb_loop(i) for i in range(args.bombs)]
            tasks += [slow_loop(i) for i in range(args.slow_body)]
            # 100 idle sockets per address (the per-client cap is 256).
            tasks += [idle_socket(host, port, f"127.0.1.{1 + i // 100}", deadline, idle)
                      for i in range(args.idle)]  # fmt: skip
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {"results": results, "impatient": impatient, "wrong_key": wrong, "health": health,
            "wall": wall, "bombs": bombs, "idle": idle, "slow_body": slow}


def pct(values: list[float], q: int) -> float:
    if len(values) > 1:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
    return values[0] if values else float("nan")


def summary(mix: str, run: dict, rss_peak: float) -> dict:
    results = run["results"]
    outcomes = Counter(r["outcome"] for r in results)
    full = [r for r in results if r["outcome"] == "full"]
    lat, ttft = [r["latency"] for r in full], [r["ttft"] for r in full]
    answered = [h for h in run["health"] if h is not None]
    return {
        "mix": mix, "requests": len(results), "full": outcomes["full"],
        "refused_429": outcomes["refused"], "lost": outcomes["lost"],
        "tokens_per_s": round(sum(r["tokens"] for r in full) / run["wall"], 1),
        "latency_p50_s": round(pct(lat, 50), 2), "latency_p99_s": round(pct(lat, 99), 2),
        "ttft_p50_s": round(pct(ttft, 50), 2), "ttft_p99_s": round(pct(ttft, 99), 2),
        "health_ok": f"{len(answered)}/{len(run['health'])}",
        "health_max_s": round(max(answered, default=float("nan")), 2),
        "rss_peak_mib": round(rss_peak),
        "impatient": dict(run["impatient"]), "wrong_key": dict(run["wrong_key"]),
        "bombs": dict(run["bombs"]), "idle": dict(run["idle"]), "slow_body": dict(run["slow_body"]),
        "lost_why": dict(Counter(r.get("why") for r in results if r["outcome"] == "lost")),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-concurrent", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--impatient", type=int, default=20)
    ap.add_argument("--wrong-key", type=int, default=10)
    ap.add_argument("--bombs", type=int, default=10)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--slow-body", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1, help="quiet/hostile pairs, alternating")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/load.json")
    args = ap.parse_args()
    # This process holds every idle socket of the hostile mix.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    model = {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"],
             "max_context": 8192, "max_concurrent": args.max_concurrent,
             "max_queue": args.max_queue}  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        keys = {name: add_key(home / "keys", name)
                for name in [*(f"team-{i}" for i in range(TEAM_KEYS)), "impatient"]}
        with serving([model], Path(tmp), home) as (url, proc):
            for i in range(args.runs):
                for mix in ("quiet", "hostile") if i % 2 == 0 else ("hostile", "quiet"):
                    memory = [rss_mib(proc.pid)]

                    async def sampled(hostile=mix == "hostile", memory=memory):
                        task = asyncio.ensure_future(drive(url, keys, args, hostile))
                        while not task.done():
                            await asyncio.sleep(1)
                            memory.append(rss_mib(proc.pid))
                        return await task

                    rows.append(summary(mix, asyncio.run(sampled()), max(memory)))
                    print(json.dumps(rows[-1]), flush=True)
    report(rows, args)


def report(rows: list[dict], args) -> None:
    print(f"\ndemo model, {args.clients} well-behaved streaming clients for {args.seconds:.0f} s "
          f"(+ {args.impatient} hanging up mid-prefill on {LONG_PROMPT_TOKENS}-token prompts "
          f"+ {args.wrong_key} wrong-key + {args.bombs} grammar bombs + {args.idle} idle sockets "
          f"+ {args.slow_body} slow bodies in the hostile mix), max_tokens {args.max_tokens}, "
          f"max_concurrent {args.max_concurrent}, max_queue {args.max_queue}")
    quiet = statistics.median(r["latency_p50_s"] for r in rows if r["mix"] == "quiet")
    cols = ["mix", "requests", "full", "refused_429", "lost", "tokens_per_s", "latency_p50_s",
            "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "health_ok", "health_max_s",
            "rss_peak_mib"]  # fmt: skip
    print("| " + " | ".join(cols) + " | p50 / quiet p50 |")
    print("|" + "---|" * (len(cols) + 1))
    for r in rows:
        ratio = r["latency_p50_s"] / quiet if quiet else float("nan")
        print("| " + " | ".join(str(r[c]) for c in cols) + f" | {ratio:.2f} |")
    for r in rows:
        if r["mix"] == "hostile":
            print(f"hostile clients got: impatient {r['impatient']}, wrong key {r['wrong_key']}, "
                  f"bombs {r['bombs']}, idle sockets {r['idle']}, slow bodies {r['slow_body']}")
        if r["lost_why"]:
            print(f"{r['mix']} lost:", r["lost_why"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
