"""DFlash block drafting vs the MTP head vs plain decoding, in-process, in one run.

    uv run python bench/block_vs_mtp.py [--drafter DIR] [--max-tokens 96]
        [--mtp-depths 1,3] [--dflash-depths 3,7] [--rollback tape|replay]

The demo model (default) with its MTP head and its trained DFlash drafter
(`builtin:demo-dflash`, or --drafter), greedy, one stream, per content type
(code: held-out-like stdlib prompts, the demo's domain; prose: outside it):
decode tokens/s (prefill excluded), the ratio to plain decoding (mlx-lm's
generate_step), tokens committed per round and drafts accepted per round.
No HTTP, so it runs wherever MLX runs (here on the CPU, on the GPU machine
with MLX's CUDA build). Writes JSON too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.checkpoints.builtin import default_model_path, demo_dflash_path
from specgate.engines.drafting.dflash.model import load_dflash
from specgate.engines.drafting.dflash.proposer import DFlashProposer
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.targets import target_for

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
GREEDY = SamplingParams(temperature=0.0)


def plain(model, prompt: list[int], n: int) -> tuple[int, float]:
    gen = generate_step(mx.array(prompt), model, max_tokens=n,
                        sampler=lambda lp: mx.argmax(lp, axis=-1))  # fmt: skip
    next(gen)  # the first token comes with the prefill
    t0 = time.perf_counter()
    count = sum(1 for _ in gen)
    return count, time.perf_counter() - t0


def speculative(make, prompt: list[int], n: int, depth: int) -> tuple[int, float, int, int]:
    """(tokens after the first, decode seconds, rounds, drafts accepted)."""
    request = GenerationRequest("b", "m", prompt, GREEDY, n, Plan("x", "none", depth, "spec_on"))
    d = make(request)
    step = d.prefill()
    t0 = time.perf_counter()
    tokens = rounds = accepted = 0
    while step.finish_reason is None:
        step = d.round(depth)
        tokens += len(step.tokens)
        rounds += 1
        accepted += step.stats.accepted
    return tokens, time.perf_counter() - t0, rounds, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--mtp-depths", default="1,3")
    ap.add_argument("--dflash-depths", default="3,7")
    ap.add_argument("--rollback", default="tape", choices=("tape", "replay"))
    ap.add_argument("--json", type=Path, default=Path("bench/results/block_vs_mtp.json"))
    args = ap.parse_args()
    path = args.model or default_model_path()
    model, config = load_model(path)
    loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
    trunk, head = target_for(model), load_mtp_head(loaded)
    drafter = load_dflash(args.drafter or demo_dflash_path())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    n = args.max_tokens

    def mtp(request):
        return SpecDecoder(trunk, MTPProposer(trunk, head), request, None, 0, None,
                           undo=args.rollback)

    def dflash(request):
        return SpecDecoder(trunk, DFlashProposer(trunk, drafter), request, None, 0, None,
                           undo=args.rollback)

    plans = [("plain", None, 0)]
    plans += [(f"mtp d={d}", mtp, d) for d in map(int, args.mtp_depths.split(","))]
    plans += [(f"dflash d={d}", dflash, d) for d in map(int, args.dflash_depths.split(","))]
    results = {"device": str(mx.default_device()), "model": str(path), "max_tokens": n,
               "rollback": args.rollback, "rows": []}  # fmt: skip
    print(f"model {path}  device {mx.default_device()}  greedy  {n} tokens  "
          f"{len(PROMPTS['code'])} prompts per content type  rollback {args.rollback}")
    print("| content | plan | decode tok/s | vs plain | tokens/round | drafts accepted/round |")
    print("|---|---|---|---|---|---|")
    for content, texts in PROMPTS.items():
        prompts = [tok.encode(t).ids for t in texts]
        base = None
        for label, make, depth in plans:
            # Warm-up: every shape compiles (and on the GPU JITs) before it is timed.
            if make is None:
                plain(model, prompts[0], 16)
                runs = [plain(model, p, n) + (0, 0) for p in prompts]
            else:
                speculative(make, prompts[0], 16, depth)
                runs = [speculative(make, p, n, depth) for p in prompts]
            tokens, secs = sum(r[0] for r in runs), sum(r[1] for r in runs)
            rounds, accepted = sum(r[2] for r in runs), sum(r[3] for r in runs)
            tps = tokens / secs
            base = base or tps
            per_round = f"{tokens / rounds:.2f}" if rounds else "1.00"
            acc = f"{accepted / rounds:.2f}" if rounds else "-"
            print(f"| {content} | {label} | {tps:.1f} | {tps / base:.2f} | {per_round} | {acc} |",
                  flush=True)
            results["rows"].append({"content": content, "plan": label, "tokens_per_s": tps,
                                    "ratio": tps / base, "rounds": rounds, "tokens": tokens,
                                    "accepted": accepted})  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
