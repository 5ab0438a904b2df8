"""specgate's plans vs always-speculate vs never-speculate vs the best fixed choice,
with and without a `specgate tune` prior, in one run.

    uv run python bench/policy_replay.py [--requests 8] [--passes 5] [--max-tokens 64]

A mixed workload, regime by regime: on the demo model one stream at a time
(code prompts; with presence/frequency penalties; with ~2k-token prompts),
4 and 8 concurrent streams; and one stream on a tiny checkpoint whose MTP
head is aligned to its trunk (every draft accepted: the regime whose best
plan *is* speculation on this CPU). Each regime runs three ways: with no
header (specgate's policy, learning only from its own requests), forced
`X-Specgate-Method: mtp` (always speculate) and forced `none` (never), those
two on a twin model id sharing the same weights in the same gateway (so its
policy learns nothing from them, and every variant runs on the same process
with the same compiled shapes); in --passes passes whose
order rotates (this machine is shared: drift in its speed would otherwise
favour whichever variant ran first). The whole replay runs twice: "untuned"
(an empty SPECGATE_HOME: the policy learns from nothing) and "tuned"
(`specgate tune` run first for both models: the prior).
The oracle is the better of the two fixed choices per regime. Reported:
aggregate generated tokens/s per regime, and the totals as ratios; the goal
is >= 95% of the oracle and never more than 2% below never-speculate. And
per request (policies/request_guard.py bounds each one): the time the same
request (same prompt, same pass) took forced plain over the time it took
under the policy, median [min]; the goal is no single request below 0.9x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from serving import REPO, serving

CODE = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "def _check_arg(value, name):\n    if not isinstance(",
    "try:\n    import _thread\nexcept ImportError:\n",
    "for i in range(len(items)):\n",
    "if __name__ == '__main__':\n",
    "    def __repr__(self):\n        return",
    "from collections import",
]
PROSE = [
    "The history of the city begins with a small fishing village on the river,",
    "Dear team, thank you all for the work on last quarter's release. Looking back,",
    "In the morning the fog lifted slowly from the valley, and the travellers",
    "There are three reasons why the committee decided to postpone the vote:",
    "She had never seen the sea before. When the train finally came out of the tunnel",
    "A good recipe for bread needs only four things: flour, water, salt and",
    "The report concludes that the new schedule improved attendance, although",
    "Once upon a time, in a kingdom far to the north, there lived a clockmaker who",
]
LONG = "".join(Path(f).read_text(errors="replace") for f in sorted(
    (Path(os.__file__).parent / "json").glob("*.py")))[:9000]  # ~2k demo tokens
REGIMES = {  # name: (model, concurrency, extra body, prompt maker)
    # (the long-prompt regime runs a quarter of --requests: each takes ~10 s to prefill here)
    "1 stream": ("demo", 1, {}, lambda i: CODE[i % len(CODE)]),
    "1 stream, penalties": ("demo", 1, {"presence_penalty": 0.3, "frequency_penalty": 0.2},
                            lambda i: CODE[i % len(CODE)]),
    "1 stream, long prompt": ("demo", 1, {}, lambda i: LONG[i * 97 :] + "\ndef "),
    "1 stream, prose": ("demo", 1, {}, lambda i: PROSE[i % len(PROSE)]),
    "4 streams": ("demo", 4, {}, lambda i: CODE[i % len(CODE)]),
    "8 streams": ("demo", 8, {}, lambda i: CODE[i % len(CODE)]),
    # Longer outputs: a request's fixed costs (HTTP, prefill) would hide most
    # of what speculation wins on a model this small.
    "aligned head, 1 stream": ("aligned", 1, {"max_tokens": 256}, lambda i: CODE[i % len(CODE)]),
}
VARIANTS = {"specgate": None, "always": "mtp", "never": "none"}


async def one(client: httpx.AsyncClient, model: str, prompt: str, body: dict,
              method: str | None, n: int):  # fmt: skip
    headers = {"X-Specgate-Method": method} if method else {}
    r = await client.post("/v1/completions", headers=headers, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, **body})  # fmt: skip
    r.raise_for_status()
    plan = dict(kv.split("=") for kv in r.headers["x-specgate-plan"].split(";"))
    return r.json()["usage"]["completion_tokens"], f"{plan['reason']}/{plan['source']}"


def request_ratios(never: list[dict], policy: list[dict]) -> list[float]:
    """Per request and pass: its seconds forced plain over its seconds under
    the policy (the same prompt and token count: speed relative to plain)."""
    return [n[i] / s[i] for n, s in zip(never, policy, strict=True) for i in s if i in n]


async def regime(url: str, name: str, method: str | None, requests: int, n: int):
    """Tokens, seconds and plans of one regime's requests, and each request's
    own seconds (by its index: the same prompt in every variant)."""
    model, concurrency, body, prompt = REGIMES[name]
    model += FORCED if method else ""
    requests = max(2, requests // 4) if "long" in name else requests
    plans: Counter = Counter()
    each: dict[int, float] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        queue = list(range(requests))
        tokens = 0

        async def worker():
            nonlocal tokens
            while queue:
                i = queue.pop()
                start = time.perf_counter()
                got, plan = await one(client, model, prompt(i), body, method, n)
                each[i] = time.perf_counter() - start
                tokens += got
                plans[plan] += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens, time.perf_counter() - t0, plans, each


FORCED = "-forced"  # the twin model id the forced variants and the warm-up use


def models(aligned: Path) -> list[dict]:
    # Every variant sends the same prompts: a prefix cache would hand the
    # later ones free prefills.
    common = {"engines": ["mlx_plain", "mlx_mtp"], "mtp_depth": 3, "max_context": 8192,
              "prefix_cache_size": 0}
    return [{"id": name + twin, "path": path, **common}
            for name, path in (("demo", "builtin:demo"), ("aligned", str(aligned)))
            for twin in ("", FORCED)]


def replay(prior: str, aligned: Path, work: Path, args) -> dict:
    home = work / f"home-{prior}"
    if prior == "tuned":
        for model in ("builtin:demo", str(aligned)):
            print(f"specgate tune {model} ...", flush=True)
            subprocess.run([sys.executable, "-m", "specgate", "tune", model], cwd=REPO,
                           env=os.environ | {"SPECGATE_HOME": str(home)}, check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
    (work / prior).mkdir()
    rows = {}
    with serving(models(aligned), work / prior, home) as (url, _):
        for name in REGIMES:
            # An untimed pass first, on the twin: batch shapes compile once.
            asyncio.run(regime(url, name, "none", REGIMES[name][1], 8))
            asyncio.run(regime(url, name, "mtp", 1, 8))
            totals = {v: [0, 0.0, Counter(), [], []] for v in VARIANTS}
            for p in range(args.passes):
                order = list(VARIANTS)[p % 3:] + list(VARIANTS)[: p % 3]
                for variant in order:
                    tokens, seconds, plans, each = asyncio.run(regime(
                        url, name, VARIANTS[variant], args.requests, args.max_tokens))
                    t = totals[variant]
                    t[0], t[1] = t[0] + tokens, t[1] + seconds
                    t[2].update(plans)
                    t[3].append(tokens / seconds)
                    t[4].append(each)
            for variant, (tokens, seconds, plans, passes, each) in totals.items():
                rows[(name, variant)] = (tokens / seconds, plans, passes, each)
                print(f"  [{prior}] {name:24s} {variant:9s} {tokens / seconds:7.1f} tok/s  "
                      f"{dict(plans)}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="requests per regime, variant and pass")
    ap.add_argument("--passes", type=int, default=5, help="passes per regime, variants rotating")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--priors", default="untuned,tuned", help="which replays to run")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/policy_replay.json")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from specgate.builders.tiny import build_qwen35_hybrid

        aligned = build_qwen35_hybrid(work / "qwen35-aligned", seed=0, aligned_mtp=True)
        for prior in args.priors.split(","):
            out[prior] = report(prior, replay(prior, aligned, work, args), args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


def report(prior: str, rows: dict, args) -> list[dict]:
    print(f"\n{prior}: greedy, {args.max_tokens} tokens x {args.requests} requests x "
          f"{args.passes} passes per regime and variant")
    print("| regime | specgate tok/s | always | never | oracle | specgate/oracle | "
          "per pass: median [min-max] (first: learning) | per request vs never: median [min] "
          "| specgate's plans (reason/source) |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals = Counter()
    out = []
    worst = (float("inf"), "")
    for name in REGIMES:
        s, a, n = (rows[(name, v)][0] for v in VARIANTS)
        oracle = max(a, n)
        totals.update({"specgate": s, "always": a, "never": n, "oracle": oracle})
        plans = ", ".join(f"{k} {v}" for k, v in rows[(name, "specgate")][1].items())
        per_pass = [sp / max(ap, np_) for sp, ap, np_ in
                    zip(*(rows[(name, v)][2] for v in VARIANTS), strict=True)]  # fmt: skip
        per_request = request_ratios(rows[(name, "never")][3], rows[(name, "specgate")][3])
        worst = min(worst, (min(per_request), name))
        print(f"| {name} | {s:.1f} | {a:.1f} | {n:.1f} | {oracle:.1f} | {s / oracle:.2f} | "
              f"{statistics.median(per_pass):.2f} [{min(per_pass):.2f}-{max(per_pass):.2f}] "
              f"({per_pass[0]:.2f}) | {statistics.median(per_request):.2f}x "
              f"[{min(per_request):.2f}x] | {plans} |")
        out.append({"regime": name, "specgate": s, "always": a, "never": n, "oracle": oracle,
                    "per_pass_vs_oracle": per_pass, "per_request_vs_never": per_request})
    print(f"| **all (sum of tok/s)** | {totals['specgate']:.1f} | {totals['always']:.1f} | "
          f"{totals['never']:.1f} | {totals['oracle']:.1f} | "
          f"{totals['specgate'] / totals['oracle']:.2f} | | vs never: "
          f"{totals['specgate'] / totals['never']:.2f} | |", flush=True)
    print(f"slowest single request under the policy: {worst[0]:.2f}x plain ({worst[1]}; goal "
          f">= 0.9x: {'met' if worst[0] >= 0.9 else 'not met'})", flush=True)
    return out


if __name__ == "__main__":
    main()
