"""What a front node costs: the same requests to a peer directly and through
a front that relays them, side by side in one run.

    uv run python bench/peers.py [--passes 3] [--requests 20]

A peer `specgate serve` with the demo model, and a front `specgate serve`
with no model and the peer under `peers:`. Each pass sends short greedy
completions (8 tokens, whole), and streams of 64 tokens, one at a time,
alternating direct and through the front; and count_tokens requests, which
the peer answers without a forward: the relay's own cost. Reported: median
over passes of the median request time, range over passes in brackets, and
the front's added milliseconds; for streams, time to first token and decode
tokens/s. All three processes share this machine's cores: while the peer
decodes, the front's relaying competes with it for them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from serving import serving

DEMO = {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain"]}


def whole(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1e3


def count_tokens(url: str) -> float:
    """A request the peer answers without the model's forward: the relay alone."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/messages/count_tokens", timeout=60, json={
        "model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1e3


def stream(url: str, tokens: int = 64) -> tuple[float, float]:
    """(ms to the first token, decode tokens/s)."""
    t0 = time.perf_counter()
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": "Count:", "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return (stamps[0] - t0) * 1e3, (tokens - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        peer_dir, front_dir = Path(work) / "peer", Path(work) / "front"
        peer_dir.mkdir()
        front_dir.mkdir()
        with serving([DEMO], peer_dir, home=peer_dir / "home") as (peer, _):
            front_config = {"peers": [{"name": "peer", "url": peer, "health_interval_s": 1}]}
            with serving([], front_dir, home=front_dir / "home", extra=front_config) as (front, _):
                deadline = time.monotonic() + 30
                while httpx.get(front + "/ready").status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.2)
                for url in (peer, front):  # warm
                    whole(url)
                    stream(url, 8)
                rows: dict[str, dict[str, list[float]]] = {}
                for _ in range(args.passes):
                    for name, url in (("direct", peer), ("via front", front)):
                        counts = [count_tokens(url) for _ in range(args.requests)]
                        times = [whole(url) for _ in range(args.requests)]
                        streams = [stream(url) for _ in range(max(1, args.requests // 4))]
                        row = rows.setdefault(name, {"count": [], "whole": [], "ttft": [], "tps": []})
                        row["count"].append(statistics.median(counts))
                        row["whole"].append(statistics.median(times))
                        row["ttft"].append(statistics.median(s[0] for s in streams))
                        row["tps"].append(statistics.median(s[1] for s in streams))

    def cell(values: list[float], fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    print(f"\ndemo model, {args.requests} whole requests (8 tokens) and {max(1, args.requests // 4)} "
          f"streams (64 tokens) per pass, {args.passes} passes: median (range over passes)\n")
    print("| path | count_tokens ms | whole request ms | stream TTFT ms | stream decode tok/s |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {cell(row['count'], '{:.2f}')} | {cell(row['whole'])} | {cell(row['ttft'])} "
              f"| {cell(row['tps'], '{:.0f}')} |")
    for what in ("count", "whole"):
        added = statistics.median(rows["via front"][what]) - statistics.median(rows["direct"][what])
        print(f"the front adds {added:.1f} ms to {'a count_tokens' if what == 'count' else 'a whole'} "
              "request (median of medians)")


if __name__ == "__main__":
    main()
