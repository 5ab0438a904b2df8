"""The policy under concurrency against plain batching, through a real gateway (issue 45).

    uv run python bench/batch_policy.py [--streams 1,2,4,8] [--reps 5] [--tokens 48]

Starts `specgate serve` on loopback with the demo model on its plain and
MTP engines (the policy deciding between them), then at each number of
concurrent streams sends that many streaming chat requests at once, three
times per repeat in rotating order: with `X-Specgate-Method: none` (plain
continuous batching), without (the policy's plan for every request and
every round), and with `X-Specgate-Method: mtp` (speculation in the MTP
engine's batch, every request held to it). Prints, per stream count,
aggregate completion tokens/s of each and their ratios over plain, median
[min, max] over the repeats, and the plans decided (the gateway's
/metrics). Issue 45 asks that the policy never make a batch slower than
plain batching by more than 3 % on a CPU.

Each request gets its own prompt (code-like text with its stream, repeat
and side in it), so neither side is served from the other's prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving import serving  # noqa: E402


def prompt(i: int, rep: int, side: str) -> str:
    """Its own text per request, repeat and side: no side finds another's
    prompt in the prefix cache."""
    return (f"def handler_{side}{rep}_{i}(request):\n    # parse the body and answer\n"
            f"    body = request.json()\n    for item in body['items'][{i}:]:\n")  # fmt: skip


SIDES = ("plain", "policy", "mtp")  # X-Specgate-Method none, nothing, mtp


async def one(client: openai.AsyncOpenAI, text: str, tokens: int, side: str) -> int:
    headers = {} if side == "policy" else {"X-Specgate-Method": "none" if side == "plain" else side}
    stream = await client.chat.completions.create(
        model="specgate-demo", messages=[{"role": "user", "content": text}], max_tokens=tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_headers=headers)  # fmt: skip
    used = 0
    async for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return used


async def burst(url: str, streams: int, rep: int, tokens: int, side: str) -> float:
    """Aggregate completion tokens/s of `streams` requests sent at once."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) as client:
        t0 = time.perf_counter()
        used = await asyncio.gather(*(one(client, prompt(i, rep, side), tokens, side) for i in range(streams)))
        return sum(used) / (time.perf_counter() - t0)


def plans_of_last(url: str, n: int) -> list[str]:
    """The plans (`mtp>none>mtp`: its methods in order) of the last `n`
    requests, from the admin page's data (an open loopback server's)."""
    recent = httpx.get(f"{url}/admin/status", timeout=30).json()["recent"]
    return [r["plan"] or "-" for r in recent if r["path"] == "/v1/chat/completions"][-n:]


def summary(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    counts = [int(x) for x in a.streams.split(",")]
    rows = {}
    model = {"id": "specgate-demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"]}
    with tempfile.TemporaryDirectory() as tmp, serving([model], Path(tmp), home=Path(tmp) / "home") as (url, _):
        for n in counts:  # untimed: each batch width's graphs built once
            for side in SIDES:
                asyncio.run(burst(url, n, -1, 8, side))
        paths = {}
        for n in counts:
            got = {side: [] for side in SIDES}
            paths[n] = Counter()
            for rep in range(a.reps):
                for side in SIDES[rep % 3 :] + SIDES[: rep % 3]:  # each goes first in turn
                    got[side].append(asyncio.run(burst(url, n, rep, a.tokens, side)))
                    if side == "policy":
                        paths[n].update(plans_of_last(url, n))
                print(f"  {n} streams, repeat {rep + 1}: "
                      + ", ".join(f"{side} {got[side][-1]:.1f}" for side in SIDES) + " tok/s", flush=True)
            rows[n] = got
        # Every plan decided, warm-up included (the gateway's /metrics).
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        plans = re.findall(r'^specgate_plan_decisions_total\{(.*)\} (\S+)$', metrics, re.M)
    print(f"\n## the policy vs plain batching (demo model, this machine; {a.reps} repeats, "
          f"{a.tokens} tokens a request)")  # fmt: skip
    print("streams | plain tok/s | policy tok/s | mtp tok/s | policy / plain | mtp / plain")
    for n, got in rows.items():
        ratios = [[x / p for x, p in zip(got[side], got["plain"], strict=True)] for side in ("policy", "mtp")]
        print(f"{n} | " + " | ".join(summary(got[side], ".1f") for side in SIDES) + " | "
              + " | ".join(summary(r) for r in ratios))
    print("the policy side's requests by their plans in order (access log's `plan`):")
    for n, count in paths.items():
        print(f"  {n} streams: " + ", ".join(f"{plan} x{k}" for plan, k in count.most_common()))
    print("plans decided (requests and rounds, both sides, warm-up included):")
    for labels, count in plans:
        print(f"  {labels}: {float(count):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
