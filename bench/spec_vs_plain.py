"""MTP speculative decoding vs plain decoding, side by side in one run.

    uv run python bench/spec_vs_plain.py [--model DIR] [--max-tokens 64] [--prompts 6]

On the demo model (default) and held-out code prompts, single stream:
- plain: mlx-lm's own generate_step (what plain decoding of one stream is);
- mtp at depth 1..4, greedy and at temperature 0.7 (with top-p 0.95);
tokens/s of the decode phase (prefill excluded), the ratio to plain, mean
tokens per round, acceptance per draft position, and the analytical speedup
those acceptances allow given the measured costs on this machine:

    expected = E[tokens per round] * c(1) / (c(k+1) + k * h)

where c(M) is a trunk forward over M new tokens (at the prompts' context)
and h is one MTP head step. Also: the two rollback implementations (taped
state vs checkpoint + replay) at depth 2, greedy. Writes JSON too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.sampling import sample
from specgate.engines.targets import target_for
from specgate.kernels.cache_undo import checkpoint, restore

PROMPTS = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return",
    "def _check_arg(value, name):\n    if not isinstance(",
    "try:\n    import _thread\nexcept ImportError:\n",
    "for i in range(len(items)):\n",
    "        raise ValueError(",
    "if __name__ == '__main__':\n",
]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plain(model, prompt: list[int], params: SamplingParams, n: int) -> tuple[int, float]:
    """(tokens, decode seconds) with mlx-lm's generate_step."""
    position = itertools.count(len(prompt))  # a seeded token's noise is its position's
    gen = generate_step(mx.array(prompt), model, max_tokens=n,
                        sampler=lambda lp: sample(lp, params, next(position)))  # fmt: skip
    next(gen)  # the first token comes with the prefill
    t0 = time.perf_counter()
    count = 1 + sum(1 for _ in gen)
    return count - 1, time.perf_counter() - t0


def speculative(trunk, head, prompt, params, n, depth, rollback="tape"):
    request = GenerationRequest("b", "m", prompt, params, n, Plan("mlx_mtp", "mtp", depth, "spec_on"))
    d = SpecDecoder(trunk, MTPProposer(trunk, head), request, None, 0, None, undo=rollback)
    step = d.prefill()
    t0 = time.perf_counter()
    rounds, tokens, per_pos = 0, 0, [0] * depth
    while step.finish_reason is None:
        step = d.round(depth)
        rounds += 1
        tokens += len(step.tokens)
        for j, ok in enumerate(step.stats.accepted_per_position):
            per_pos[j] += ok
    return tokens, time.perf_counter() - t0, rounds, per_pos


def cost_curve(trunk, head, context: list[int], widths=range(1, 6), reps=20) -> tuple[dict, float]:
    """Median seconds of a trunk forward over M new tokens after `context`,
    and of one head step."""
    cache = trunk.make_cache()
    mx.eval(trunk.forward(mx.array([context]), cache).hidden)
    costs = {}
    for m in widths:
        samples = []
        for _ in range(reps):
            saved = checkpoint(cache)
            samples.append(timed(lambda m=m: mx.eval(trunk.forward(mx.array([context[:m]]), cache).hidden)))
            restore(cache, saved)
        costs[m] = statistics.median(samples)
    head_cache = head.make_cache()
    h = mx.zeros((1, 1, trunk.inner.embed_tokens.weight.shape[1]))
    e = trunk.embed(mx.array([[1]]))
    steps = [timed(lambda: mx.eval(head(e, h, head_cache))) for _ in range(reps)]
    return costs, statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--json", type=Path, default=Path("bench/results/spec_vs_plain.json"))
    args = ap.parse_args()
    path = args.model or default_model_path()
    model, config = load_model(path)
    loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
    trunk, head = target_for(model), load_mtp_head(loaded)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS[: args.prompts]]
    depths = [int(d) for d in args.depths.split(",")]
    settings = {"greedy": SamplingParams(temperature=0.0, seed=0),
                "T=0.7": SamplingParams(temperature=0.7, top_p=0.95, seed=0)}  # fmt: skip
    n = args.max_tokens

    speculative(trunk, head, prompts[0], settings["greedy"], 8, 2)  # warm up
    plain(model, prompts[0], settings["greedy"], 8)
    costs, h = cost_curve(trunk, head, prompts[0] * 4)
    rows, results = [], {"device": str(mx.default_device()), "model": str(path), "costs_s": costs,
                         "head_step_s": h, "runs": []}  # fmt: skip
    for name, params in settings.items():
        plain(model, prompts[0], params, n)  # warm-up
        base_tok, base_s = map(sum, zip(*(plain(model, p, params, n) for p in prompts), strict=True))
        base = base_tok / base_s
        rows.append((name, "plain", "", f"{base:7.1f}", "1.00", "1.00", "", ""))
        for depth in depths:
            speculative(trunk, head, prompts[0], params, n, depth)  # warm-up: kernels per shape
            runs = [speculative(trunk, head, p, params, n, depth) for p in prompts]
            tokens = sum(r[0] for r in runs)
            secs = sum(r[1] for r in runs)
            rounds = sum(r[2] for r in runs)
            per_pos = [sum(r[3][j] for r in runs) / rounds for j in range(depth)]
            per_round = tokens / rounds
            # What this acceptance is worth at this machine's measured costs.
            expected = per_round * costs[1] / (costs[depth + 1] + depth * h)
            tps = tokens / secs
            rows.append((name, f"mtp d={depth}", f"{per_round:4.2f}", f"{tps:7.1f}",
                         f"{tps / base:4.2f}", f"{expected:4.2f}",
                         " ".join(f"{a:.2f}" for a in per_pos), ""))  # fmt: skip
            results["runs"].append({"sampling": name, "depth": depth, "tokens_per_s": tps,
                                    "plain_tokens_per_s": base, "tokens_per_round": per_round,
                                    "acceptance_per_position": per_pos,
                                    "expected_speedup": expected})  # fmt: skip
    cap = [speculative(trunk, head, p, settings["greedy"], n, 2, "tape") for p in prompts]
    rep = [speculative(trunk, head, p, settings["greedy"], n, 2, "replay") for p in prompts]
    cap_tps = sum(r[0] for r in cap) / sum(r[1] for r in cap)
    rep_tps = sum(r[0] for r in rep) / sum(r[1] for r in rep)
    results["rollback"] = {"capture_tokens_per_s": cap_tps, "replay_tokens_per_s": rep_tps}

    print(f"model {path}  device {mx.default_device()}  {len(prompts)} prompts x {n} tokens")
    print("verify cost c(M)/c(1): " + "  ".join(f"M={m}: {c / costs[1]:.2f}" for m, c in costs.items())
          + f"   (c(1) = {costs[1] * 1e3:.2f} ms; head step {h / costs[1]:.2f} c(1))")  # fmt: skip
    head_row = ("sampling", "plan", "tok/round", "tok/s", "ratio", "bound", "acceptance by position")
    print(" | ".join(f"{c:>10}" for c in head_row))
    print("-" * 96)
    for r in rows:
        print(" | ".join(f"{c:>10}" for c in r[:7]))
    print(f"rollback at depth 2, greedy: taped state {cap_tps:.1f} tok/s, checkpoint + replay "
          f"{rep_tps:.1f} tok/s ({cap_tps / rep_tps:.2f}x)")
    print("(ratio = mtp tok/s / plain tok/s, decode phase; bound = acceptance-implied speedup "
          "from the measured cost curve)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
