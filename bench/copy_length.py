"""Copies verified whole vs cut by the engine's evidence, side by side, on the agent transcripts.

    uv run python bench/copy_length.py [--reps 5] [--depth 8]

The demo model, in-process (engines/mlx_spec/decoder.py with the ngram proposer,
greedy, 256 tokens: the same tokens either way), on bench/agent_transcripts.json.
Per transcript, after `--learn` requests that teach a CopyEvidence
(engines/drafting/ngram/copy_length.py) as an engine's requests would, `--reps`
rounds of three decodes in rotating order: depth 0 (every round a plain
step through the same decoder), copies whole (no evidence, what the ngram
proposer did before), copies cut by the evidence. Reported:

- timed: tokens/s as the median of the reps with its range, and the ratio
  to depth 0 (median of per-rep ratios, with their range);
- modelled: the same decodes' verify widths priced with one table (the
  evidence's own timed cost of each width), so the ratio of whole to cut is
  free of this shared machine's drift between two runs: what the cut saves
  in rows against what it loses in tokens per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_workloads import load_transcripts, without_tools  # noqa: E402

VARIANTS = ("depth 0", "whole", "cut")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--learn", type=int, default=3, help="requests that teach the evidence first")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()

    from specgate.engines.base import GenerationRequest, Plan, SamplingParams
    from specgate.engines.checkpoints.builtin import default_model_path
    from specgate.engines.drafting.ngram.copy_length import CopyEvidence
    from specgate.engines.drafting.ngram.proposer import NgramProposer
    from specgate.engines.loading import load_mlx_model
    from specgate.engines.mlx_spec.decoder import SpecDecoder
    from specgate.engines.targets import target_for

    loaded = load_mlx_model(str(default_model_path()))
    target = target_for(loaded.model)

    def prompt_of(t: dict) -> list[int]:
        t = without_tools(t) if t.get("tools") else t
        p = loaded.tokenizer.apply_chat_template(t["messages"], add_generation_prompt=True)
        return loaded.tokenizer.encode(p) if isinstance(p, str) else list(p)

    def decode(prompt, proposer, depth):
        request = GenerationRequest("b", "demo", prompt, SamplingParams(temperature=0), args.max_tokens,
                                    Plan("mlx_ngram", "ngram", depth, "spec_on"))  # fmt: skip
        decoder = SpecDecoder(target, proposer, request, None, 0, None)
        step, widths, tokens = decoder.prefill(), [], []
        t0 = time.perf_counter()
        while step.finish_reason is None:
            step = decoder.round(depth)
            widths.append(step.stats.verify_width)
            tokens += step.tokens
        return tokens, widths, len(tokens) / (time.perf_counter() - t0)

    rows = []
    for t in load_transcripts():
        prompt, evidence = prompt_of(t), CopyEvidence()
        for _ in range(args.learn):
            decode(prompt, NgramProposer(evidence=evidence), args.depth)
        runs = {v: [] for v in VARIANTS}
        for rep in range(args.reps):
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
            for v in order:
                proposer = NgramProposer(evidence=evidence if v == "cut" else None)
                runs[v].append(decode(prompt, proposer, 0 if v == "depth 0" else args.depth))
        same = {tuple(r[0]) for rs in runs.values() for r in rs}
        assert len(same) == 1, f"{t['name']}: the variants decoded different tokens"
        price = evidence.costs(args.depth + 1)
        for v in VARIANTS:
            tps = [r[2] for r in runs[v]]
            ratios = [r[2] / base[2] for r, base in zip(runs[v], runs["depth 0"], strict=True)]
            n, widths = len(runs[v][0][0]), runs[v][0][1]
            modelled = n * price[0] / sum(price[w - 1] for w in widths) if price else float("nan")
            rows.append((t["name"], v, statistics.median(tps), min(tps), max(tps),
                         statistics.median(ratios), min(ratios), max(ratios), n / len(widths),
                         modelled))  # fmt: skip
    print(f"demo model, ngram at depth {args.depth}, {args.reps} reps after {args.learn} learning requests\n")
    print("transcript               | variant | tok/s median [range]  | x depth 0 median [range] "
          "| tok/round | modelled x depth 0")  # fmt: skip
    for name, v, med, lo, hi, r, rlo, rhi, tpr, modelled in rows:
        print(f"{name:24s} | {v:7s} | {med:6.1f} [{lo:5.1f}-{hi:5.1f}] | {r:5.2f}x [{rlo:.2f}-{rhi:.2f}]"
              f"        | {tpr:9.2f} | {modelled:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
