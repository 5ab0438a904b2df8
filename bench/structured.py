"""Structured outputs through the gateway: plain vs each speculative method,
with the grammar's mask on and off, side by side in one run.

    uv run python bench/structured.py [--passes 3] [--max-tokens 256] [--depth 3]

One `specgate serve` serves the shipped demo model with plain decoding,
MTP, DFlash (its trained drafter) and ngram copies. Each prompt asks for a
JSON description of a Python symbol, greedy, streamed, one at a time, each
method forced with X-Specgate-Method:

- mask on: `response_format` json_schema (strict), so every position is
  masked by the grammar, drafts and verify alike;
- mask off: the same chat without response_format (the demo then writes
  code), cut at --max-tokens.

Reported per mode and method: decode tokens/s (first streamed token to
last), the median over prompts in each pass, then the median over passes
and its range; the ratio to plain in the same mode; acceptance (accepted /
drafted) and tokens per round from specgate's own /metrics.
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

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "arguments": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "type": {"enum": ["str", "int", "float", "bool", "list", "dict", "Any"]}},
            "required": ["name", "type"], "additionalProperties": False}},
        "returns": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "summary", "arguments", "returns"],
    "additionalProperties": False,
}  # fmt: skip
PROMPTS = [f"Describe the Python function `{name}` as JSON."
           for name in ("os.path.join", "json.loads", "re.compile", "shutil.copytree")]
METHODS = ["none", "mtp", "dflash", "ngram"]
MODES = ["mask on", "mask off"]
SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def stream_one(client: httpx.Client, method: str, prompt: str, mode: str,
               max_tokens: int) -> tuple[int, float]:  # fmt: skip
    """(tokens after the first, seconds from first to last) of one greedy stream."""
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0, "max_tokens": max_tokens, "return_token_ids": True}
    if mode == "mask on":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "f", "schema": SCHEMA, "strict": True}}
    times, count, text, finish = [], 0, [], None
    with client.stream("POST", "/v1/chat/completions", json=body,
                       headers={"X-Specgate-Method": method}) as r:
        if r.status_code != 200:
            sys.exit(f"{method}/{mode}: HTTP {r.status_code}: {r.read().decode()}")
        lines = r.iter_lines()
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
            if ids := choice.get("token_ids"):
                times.append(time.perf_counter())
                count += len(ids)
    if mode == "mask on" and finish == "stop":
        json.loads("".join(text))  # what the grammar ended is valid JSON
    return count - 1, times[-1] - times[0]


def spec_counts(client: httpx.Client, method: str) -> dict[str, float]:
    out = dict.fromkeys(SPEC_METRICS, 0.0)
    for line in client.get("/metrics").text.splitlines():
        for name in SPEC_METRICS:
            if line.startswith(f"specgate_spec_decode_{name}_total{{") \
                    and f'method="{method}"' in line and 'model="demo"' in line:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run(url: str, args) -> dict:
    per_pass: dict = {}  # (mode, method) -> [median tok/s of each pass]
    counts: dict = {}  # (mode, method) -> spec counters summed over passes
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as client:
        for method in METHODS:  # warm-up: graphs, first grammar, prompt cache
            for mode in MODES:
                stream_one(client, method, PROMPTS[0], mode, 16)
        for p in range(args.passes):
            for mode in MODES:
                for method in METHODS:
                    before = spec_counts(client, method)
                    rates = [n / s for n, s in (stream_one(client, method, q, mode, args.max_tokens)
                                                for q in PROMPTS)]  # fmt: skip
                    after = spec_counts(client, method)
                    per_pass.setdefault((mode, method), []).append(statistics.median(rates))
                    c = counts.setdefault((mode, method), dict.fromkeys(SPEC_METRICS, 0.0))
                    for k in SPEC_METRICS:
                        c[k] += after[k] - before[k]
                    print(f"  pass {p + 1} {mode:8s} {method:6s} {per_pass[(mode, method)][-1]:7.1f} "
                          "tok/s", flush=True)
    return {"per_pass": per_pass, "counts": counts}


def report(results: dict, args) -> None:
    per_pass, counts = results["per_pass"], results["counts"]
    print(f"\ndemo model, greedy chat, {len(PROMPTS)} prompts, {args.passes} passes, "
          f"depth {args.depth}; tok/s: median over passes of each pass's median (range)")
    print("| mode | method | decode tok/s | vs plain (range) | accepted/drafted | tokens/round |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for mode in MODES:
        plain = per_pass[(mode, "none")]
        for method in METHODS:
            rates = per_pass[(mode, method)]
            ratios = [r / b for r, b in zip(rates, plain, strict=True)]
            c = counts[(mode, method)]
            acc = f"{c['num_accepted_tokens'] / c['num_draft_tokens']:.3f}" if c["num_draft_tokens"] else "-"
            per_round = f"{1 + c['num_accepted_tokens'] / c['num_drafts']:.2f}" if c["num_drafts"] else "-"
            print(f"| {mode} | {method} | {statistics.median(rates):.1f} ({min(rates):.1f}-"
                  f"{max(rates):.1f}) | {statistics.median(ratios):.2f} ({min(ratios):.2f}-"
                  f"{max(ratios):.2f}) | {acc} | {per_round} |")
            rows.append({"mode": mode, "method": method, "tok_s_per_pass": rates, **c})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/structured.json")
    args = ap.parse_args()
    models = [{"id": "demo", "path": "builtin:demo", "drafter": "builtin:demo-dflash",
               "engines": ["mlx_plain", "mlx_mtp", "mlx_dflash", "mlx_ngram"],
               "mtp_depth": args.depth, "max_context": 2048}]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, serving(models, Path(tmp)) as (url, _):
        results = run(url, args)
    report(results, args)


if __name__ == "__main__":
    main()
