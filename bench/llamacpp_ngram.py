"""llama-server's n-gram speculation types on a code-copy prompt (issue 42).

Starts one llama-server per configuration (specgate's own process manager,
engines/llamacpp/process.py, so the command lines are the ones specgate
runs), asks each in turn, repeats interleaved, and prints per configuration
the median [min, max] decode tok/s and the drafts / accepted tokens from
llama-server's own timings (`draft_n`, `draft_n_accepted`).

    PYTHONPATH=. python bench/llamacpp_ngram.py MODEL.gguf [--repeats 5] [--tokens 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import httpx

from specgate.engines.llamacpp.process import LlamaServer, ServerSpec

# 65 lines of code the model is asked to reprint: a copy is all a draft from
# the context can be right about, so this is n-gram drafting's best case.
# Each repeat reprints other lines (one window of process.py per repeat, the
# same for every configuration): the n-gram types that keep a pool across
# requests (ngram-mod, ngram-map-*) would otherwise copy their own last answer.
SOURCE = Path(__file__).resolve().parents[1].joinpath(
    "specgate/engines/llamacpp/process.py").read_text().splitlines()


def prompt_for(repeat: int) -> str:
    code = "\n".join(SOURCE[200 + 65 * repeat: 265 + 65 * repeat])
    return f"Reprint this Python code exactly as it is, with no changes:\n\n```python\n{code}\n```"


CONFIGS: dict[str, dict | None] = {
    "plain": None,
    "ngram-simple m8 n12 (llama.cpp's lookup)": {"type": "ngram-simple", "n_max": 8, "lookup": 12},
    "ngram-simple m8 n4": {"type": "ngram-simple", "n_max": 8, "lookup": 4},
    "ngram-simple m8 n3": {"type": "ngram-simple", "n_max": 8, "lookup": 3},
    "ngram-mod max8 n-match4": {"type": "ngram-mod", "n_max": 8, "lookup": 4},
    "ngram-mod max8 n-match24 (llama.cpp's)": {"type": "ngram-mod", "n_max": 8, "lookup": 24},
    "ngram-map-k m8 n4": {"type": "ngram-map-k", "n_max": 8, "lookup": 4},
    "ngram-map-k4v m8 n4": {"type": "ngram-map-k4v", "n_max": 8, "lookup": 4},
}


async def run_once(client: httpx.AsyncClient, server: LlamaServer, prompt: str, tokens: int) -> dict:
    r = await client.post(server.base_url + "/completion", json={
        "prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": True})
    r.raise_for_status()
    t = r.json()["timings"]
    return {"tok_s": t["predicted_per_second"], "n": t["predicted_n"],
            "drafts": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--binary")
    ap.add_argument("--only", nargs="*", help="configurations whose names start so (plain always)")
    args = ap.parse_args()
    configs = {name: spec for name, spec in CONFIGS.items()
               if not args.only or name == "plain" or any(name.startswith(o) for o in args.only)}
    servers = {name: LlamaServer(ServerSpec(args.model, ctx_size=4096, threads=args.threads,
                                            spec=spec, extra_args=["--no-repack"]),
                                 binary=args.binary)  # fmt: skip
               for name, spec in configs.items()}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for s in servers.values():
            await s.start()
        async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
            for repeat in range(args.repeats):
                r = await client.post(servers["plain"].base_url + "/apply-template", json={
                    "messages": [{"role": "user", "content": prompt_for(repeat)}]})
                prompt = r.json()["prompt"]
                for name, s in servers.items():
                    results[name].append(await run_once(client, s, prompt, args.tokens))
    finally:
        for s in servers.values():
            await s.stop()
    print(f"65 lines of code, {args.tokens} tokens, {args.repeats} repeats, -t {args.threads}")
    for name, rs in results.items():
        speeds = [r["tok_s"] for r in rs]
        drafted, accepted = sum(r["drafts"] for r in rs), sum(r["accepted"] for r in rs)
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        print(f"{name:42s} {statistics.median(speeds):6.1f} [{min(speeds):.1f}, {max(speeds):.1f}] "
              f"tok/s; drafted {drafted}, accepted {accepted} ({rate}) over {sum(r['n'] for r in rs)} tokens")


if __name__ == "__main__":
    asyncio.run(main())
