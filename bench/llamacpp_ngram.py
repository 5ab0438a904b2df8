"""llama-server's n-gram speculation types on a code-copy prompt (issue 42).

Starts one llama-server per configuration (specgate's own process manager,
engines/llamacpp/process.py, so the command lines are the ones specgate
runs), asks each in turn, repeats interleaved, and prints per configuration
the median [min, max] decode tok/s and the drafts / accepted tokens from
llama-server's own timings (`draft_n`, `draft_n_accepted`).

    python bench/llamacpp_ngram.py MODEL.gguf [--repeats 5] [--tokens 700] [--threads 2]
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
CODE = "\n".join(Path(__file__).resolve().parents[1].joinpath(
    "specgate/engines/llamacpp/lifeline.py").read_text().splitlines()[11:76])
PROMPT = f"Reprint this Python code exactly as it is, with no changes:\n\n```python\n{CODE}\n```"

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
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--binary")
    args = ap.parse_args()
    servers = {name: LlamaServer(ServerSpec(args.model, ctx_size=4096, threads=args.threads,
                                            spec=spec, extra_args=["--no-repack"]),
                                 binary=args.binary)  # fmt: skip
               for name, spec in CONFIGS.items()}
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    try:
        for s in servers.values():
            await s.start()
        async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
            r = await client.post(servers["plain"].base_url + "/apply-template",
                                  json={"messages": [{"role": "user", "content": PROMPT}]})
            prompt = r.json()["prompt"]
            for _ in range(args.repeats):
                for name, s in servers.items():
                    results[name].append(await run_once(client, s, prompt, args.tokens))
    finally:
        for s in servers.values():
            await s.stop()
    print(f"{len(CODE.splitlines())} lines of code, {args.tokens} tokens, {args.repeats} repeats")
    for name, rs in results.items():
        speeds = [r["tok_s"] for r in rs]
        print(f"{name:42s} {statistics.median(speeds):7.1f} [{min(speeds):.1f}, {max(speeds):.1f}] "
              f"tok/s; drafts {rs[0]['drafts']} accepted {rs[0]['accepted']} (of {rs[0]['n']} tokens)")


if __name__ == "__main__":
    asyncio.run(main())
