"""Gemma-4 with its assistant drafter beside the demo model with its MTP head, in one run.

    uv run python bench/gemma4_assistant.py [--passes 3] [--tokens 96] [--depths 1,2,3]
        [--accept 0.6,0.9] [--json FILE]

In-process (no HTTP), greedy, one stream. Rows:
- gemma4 tiny: a tiny Gemma-4 (builders/gemma4.py, 8 layers, hidden
  256, window 32) and a random assistant built for it: plain decoding
  (mlx-lm's generate_step) vs the assistant drafting at each depth, with its
  own drafts (a random drafter: acceptance ~0, the cost of drafting shown
  bare) and with acceptance set by construction: the assistant drafts as
  usual, then each draft is replaced, per position, by the true greedy
  continuation with probability a, else by a wrong token (seeded); the
  verify decides as always, so the output stays exact (checked);
- demo: the shipped demo model, plain vs its own trained MTP head.
Columns: decode tokens/s (the first token, with the prefill, excluded), the
ratio to the same model's plain decoding, tokens committed per round, drafts
accepted per position. Each pass runs every row once over the prompts;
tok/s is the median over passes with the range. On this CPU the models are
too small for a round to beat a plain step: the table says what a round
costs against a step, not what a Mac gains.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from specgate.builders.drafters import build_gemma4_assistant
from specgate.builders.gemma4 import build_gemma4
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.engines.drafting.assistant.gemma4 import check_pairing, load_assistant
from specgate.engines.drafting.assistant.proposer import AssistantProposer
from specgate.engines.drafting.base import Proposal
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.targets import target_for

GREEDY = SamplingParams(temperature=0.0)


def plain(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    gen = generate_step(mx.array(prompt), model, max_tokens=n,
                        sampler=lambda lp: mx.argmax(lp, axis=-1))  # fmt: skip
    first = next(gen)[0]
    t0 = time.perf_counter()
    rest = [t for t, _ in gen]
    return [int(first), *map(int, rest)], time.perf_counter() - t0


class SetAcceptance(AssistantProposer):
    """The assistant drafts (its full cost), then each draft becomes the true
    continuation's token with probability `a`, else a wrong one."""

    def __init__(self, *args, reference: list[int], a: float, rng: random.Random):
        super().__init__(*args)
        self.reference, self.a, self.rng = reference, a, rng

    def propose(self, context, depth):
        own = super().propose(context, depth)
        mx.eval(own.drafts)
        true = self.reference[context.generated : context.generated + depth]
        true += [0] * (depth - len(true))
        drafts = [t if self.rng.random() < self.a else (t + 1) % 7 for t in true]
        return Proposal(mx.array(drafts))


def speculative(make, prompt: list[int], n: int, depth: int):
    """(tokens, decode seconds, rounds, accepted, positions drafted)."""
    request = GenerationRequest("b", "m", prompt, GREEDY, n, Plan("x", "x", depth, "spec_on"))
    d = make(request)
    step = d.prefill()
    tokens = list(step.tokens)
    t0 = time.perf_counter()
    rounds = accepted = drafted = 0
    while step.finish_reason is None:
        step = d.round(depth)
        tokens += step.tokens
        rounds += 1
        accepted += step.stats.accepted
        drafted += step.stats.drafted
    return tokens, time.perf_counter() - t0, rounds, accepted, drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--accept", default="0.6,0.9")
    ap.add_argument("--json", type=Path, default=Path("bench/results/gemma4_assistant.json"))
    args = ap.parse_args()
    n, depths = args.tokens, [int(d) for d in args.depths.split(",")]
    accepts = [float(a) for a in args.accept.split(",")] if args.accept else []

    tmp = Path(tempfile.mkdtemp(prefix="gemma4-bench-"))
    g_path = build_gemma4(tmp / "gemma4", hidden_size=256, num_hidden_layers=8,
                          intermediate_size=512, sliding_window=32, tokenizer=False)  # fmt: skip
    a_path = build_gemma4_assistant(tmp / "assistant", target=g_path, hidden_size=128,
                                    intermediate_size=256, tokenizer=False)  # fmt: skip
    g_model, _ = load_model(g_path)
    g_trunk, drafter = target_for(g_model), load_assistant(a_path)
    check_pairing(drafter, g_trunk)
    rng = random.Random(0)
    g_prompts = [[rng.randrange(2000) for _ in range(48)] for _ in range(4)]

    d_path = default_model_path()
    d_model, d_config = load_model(d_path)
    d_trunk = target_for(d_model)
    head = load_mtp_head(LoadedModel(str(d_path), d_model, None, d_config, PrefixCache(str(d_path))))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d_path / "tokenizer.json"))
    d_prompts = [tok.encode(t).ids for t in ("import os\nimport sys\n\n\ndef main():\n",
                                             "class Stack:\n    def __init__(self):\n",
                                             "def _check_arg(value, name):\n    if not isinstance(",
                                             "for i in range(len(items)):\n")]  # fmt: skip

    references = {}
    rows: list[tuple[str, str, object, int]] = [("gemma4 tiny", "plain", None, 0)]
    for d in depths:
        rows.append(("gemma4 tiny", f"assistant d={d}", "own", d))
        rows += [("gemma4 tiny", f"assistant d={d} a={a}", a, d) for a in accepts]
    rows.append(("demo", "plain", None, 0))
    rows += [("demo", f"mtp d={d}", "mtp", d) for d in depths]

    def run(model_name, how, depth, prompt, i):
        if model_name == "gemma4 tiny":
            model, trunk = g_model, g_trunk
        else:
            model, trunk = d_model, d_trunk
        if how is None:
            tokens, secs = plain(model, prompt, n)
            references[(model_name, i)] = tokens
            return tokens, secs, 0, 0, 0
        ref = references[(model_name, i)]
        if how == "mtp":
            make = lambda r: SpecDecoder(trunk, MTPProposer(trunk, head), r, None, 0, None)  # noqa: E731
        elif how == "own":
            make = lambda r: SpecDecoder(trunk, AssistantProposer(trunk, drafter), r, None, 0, None)  # noqa: E731
        else:
            make = lambda r: SpecDecoder(  # noqa: E731
                trunk, SetAcceptance(trunk, drafter, reference=ref, a=how, rng=random.Random(i)),
                r, None, 0, None)
        out = speculative(make, prompt, n, depth)
        assert out[0] == ref, f"{model_name} {how} d={depth}: output differs from plain decoding"
        return out

    samples: dict[str, list[float]] = {}
    totals: dict[str, list[int]] = {}
    for p in range(args.passes):
        for model_name, label, how, depth in rows:
            prompts = g_prompts if model_name == "gemma4 tiny" else d_prompts
            run(model_name, how, depth, prompts[0], 0)  # warm-up: shapes compile first
            outs = [run(model_name, how, depth, q, i) for i, q in enumerate(prompts)]
            decoded = sum(len(o[0]) - 1 for o in outs)
            secs = sum(o[1] for o in outs)
            samples.setdefault(f"{model_name}|{label}", []).append(decoded / secs)
            totals[f"{model_name}|{label}"] = [sum(o[k] for o in outs) for k in (2, 3, 4)] + [decoded]
        print(f"pass {p + 1}/{args.passes} done", flush=True)

    print(f"\ndevice {mx.default_device()}  greedy  {n} tokens  {args.passes} passes "
          f"(tok/s: median, range)")
    print("| model | plan | decode tok/s | vs plain | tokens/round | accepted/drafted |")
    print("|---|---|---:|---:|---:|---:|")
    results = {"device": str(mx.default_device()), "tokens": n, "passes": args.passes, "rows": []}
    for model_name, label, _how, _depth in rows:
        key = f"{model_name}|{label}"
        s, base = samples[key], samples[f"{model_name}|plain"]
        ratios = [a / b for a, b in zip(s, base, strict=True)]
        rounds, accepted, drafted, decoded = totals[key]
        per_round = f"{decoded / rounds:.2f}" if rounds else "1.00"
        acc = f"{accepted / drafted:.2f}" if drafted else "-"
        print(f"| {model_name} | {label} | {statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f}) | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{per_round} | {acc} |")
        results["rows"].append({"model": model_name, "plan": label, "tokens_per_s": s,
                                "ratios": ratios, "rounds": rounds, "accepted": accepted,
                                "drafted": drafted})  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
