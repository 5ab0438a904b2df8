"""Every way specgate can decode the demo model, side by side in one run, through one gateway.

    uv run python bench/demo_methods.py [--max-tokens 128] [--depth 3] [--repeats 1]
        [--drafter builtin:demo-dflash] [--only "mlx plain,mlx dflash"]

One `specgate serve` (a subprocess on a loopback port) serves the shipped
demo model twice: as MLX ("demo": mlx_plain, mlx_mtp with its MTP head,
mlx_dflash with its trained DFlash drafter) and as its GGUF export
("demo-gguf": llama-server plain and llama-server --spec-type draft-mtp).
Each prompt is sent greedy to each method (forced with X-Specgate-Method),
streaming, one at a time, so every method pays the same HTTP and gateway
costs. Reported per content type (code: the demo's own domain; prose:
outside it):

- decode tokens/s (first streamed token to last; prefill excluded), median
  over prompts, and its ratio to MLX plain and to the same backend's plain;
- acceptance: accepted / drafted tokens and mean tokens per round, from
  specgate's own /metrics (the same RoundStats path for both backends).

The MTP depth is --depth; DFlash verifies its whole block (block_size - 1
drafts). Needs llama-server: `specgate install-llama-server` (or one on PATH).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serving import REPO, serving

PROMPTS = {
    "code": [
        "import os\nimport sys\n\n\ndef main():\n",
        "class Stack:\n    def __init__(self):\n",
        "def _check_arg(value, name):\n    if not isinstance(",
        "try:\n    import _thread\nexcept ImportError:\n",
        "for i in range(len(items)):\n",
        "if __name__ == '__main__':\n",
    ],
    "prose": [
        "The history of the river valley begins",
        "Dear committee, I am writing to",
        "She opened the door and saw",
        "In the morning the market was",
        "The recipe calls for three eggs and",
        "Our findings suggest that the",
    ],
}
# (label, model id, forced method)
METHODS = [
    ("mlx plain", "demo", "none"),
    ("mlx mtp", "demo", "mtp"),
    ("mlx dflash", "demo", "dflash"),
    ("llama.cpp plain", "demo-gguf", "none"),
    ("llama.cpp draft-mtp", "demo-gguf", "llamacpp_mtp"),
]
SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def models(depth: int, drafter: str) -> list[dict]:
    return [
        {"id": "demo", "path": "builtin:demo",
         "engines": ["mlx_plain", "mlx_mtp", "mlx_dflash"], "mtp_depth": depth,
         "drafter": drafter},
        {"id": "demo-gguf", "path": "builtin:demo-gguf",
         "engines": ["llamacpp", "llamacpp_mtp"], "mtp_depth": depth, "max_concurrent": 1,
         "max_context": 2048},
    ]  # fmt: skip


def stream_one(client: httpx.Client, model: str, method: str, prompt: str, n: int) -> tuple[int, float]:
    """(tokens after the first, seconds from first to last token) for one greedy stream."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    times, count = [], 0
    with client.stream("POST", "/v1/completions", json=body,
                       headers={"X-Specgate-Method": method}) as r:
        if r.status_code != 200:
            sys.exit(f"{model}/{method}: HTTP {r.status_code}: {r.read().decode()}")
        lines = r.iter_lines()  # keep a reference: dropping it closes the response
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids:
                times.append(time.perf_counter())
                count += len(ids)
    assert count == n, f"{model}/{method}: {count} tokens, asked for {n}"
    return count - 1, times[-1] - times[0]


def spec_counts(client: httpx.Client, model: str, method: str) -> dict[str, float]:
    out = dict.fromkeys(SPEC_METRICS, 0.0)
    for line in client.get("/metrics").text.splitlines():
        for name in SPEC_METRICS:
            if line.startswith(f"specgate_spec_decode_{name}_total{{") \
                    and f'method="{method}"' in line and f'model="{model}"' in line:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--drafter", default="builtin:demo-dflash", help="DFlash drafter for the demo")
    ap.add_argument("--only", help="comma-separated method labels to run (default: all)")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/demo_methods.json")
    args = ap.parse_args()
    if args.only:
        wanted = {m.strip() for m in args.only.split(",")}
        METHODS[:] = [m for m in METHODS if m[0] in wanted or m[0].endswith("plain")]

    with (tempfile.TemporaryDirectory() as tmp,
          serving(models(args.depth, args.drafter), Path(tmp)) as (url, _)):
        results = run(url, args)
    report(results, args)


def run(url: str, args) -> dict:
    results: dict = {}
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
        for _, model, method in METHODS:  # warm-up: compile, load, first prompt cache
            stream_one(client, model, method, "def f():", 8)
        for content, prompts in PROMPTS.items():
            for label, model, method in METHODS:
                before = spec_counts(client, model, method)
                rates = []
                for _ in range(args.repeats):
                    for p in prompts:
                        toks, secs = stream_one(client, model, method, p, args.max_tokens)
                        rates.append(toks / secs)
                after = spec_counts(client, model, method)
                grown = {k: after[k] - before[k] for k in SPEC_METRICS}
                results[(content, label)] = {"tok_s": statistics.median(rates), **grown}
                print(f"  {content:5s} {label:20s} {results[(content, label)]['tok_s']:8.1f} tok/s",
                      flush=True)
    return results


def report(results: dict, args) -> None:
    print(f"\ndemo model, greedy, {args.max_tokens} tokens, mtp depth {args.depth}, "
          f"{len(PROMPTS['code'])} prompts per content type, one stream at a time")
    print("| content | method | decode tok/s | vs mlx plain | vs own plain | accepted/drafted "
          "| tokens/round |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for content in PROMPTS:
        mlx_plain = results[(content, "mlx plain")]["tok_s"]
        for label, _, _ in METHODS:
            r = results[(content, label)]
            own = results[(content, label.split()[0] + " plain")]["tok_s"]
            acc = (f"{r['num_accepted_tokens'] / r['num_draft_tokens']:.3f}"
                   if r["num_draft_tokens"] else "-")
            per_round = (f"{1 + r['num_accepted_tokens'] / r['num_drafts']:.2f}"
                         if r["num_drafts"] else "-")
            print(f"| {content} | {label} | {r['tok_s']:.1f} | {r['tok_s'] / mlx_plain:.2f} "
                  f"| {r['tok_s'] / own:.2f} | {acc} | {per_round} |")
            rows.append({"content": content, "method": label, **r})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
