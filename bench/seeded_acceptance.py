"""What a seed costs the MTP head: Gumbel-coupled drafts vs rejection sampling.

    uv run python bench/seeded_acceptance.py [--depth 3] [--max-tokens 48] [--seeds 4]
        [--temperatures 0.7,1.0]

A seeded request's drafts stand while each equals the target's Gumbel-max
token at its position, argmax(log q + g) == argmax(log p + g), so its text
is the same on every engine (engines/mlx_spec/acceptance.py); an unseeded
one keeps Leviathan-Chen rejection sampling, whose acceptance is the
maximal coupling sum(min(p, q)). On the demo model (its trained MTP head),
the same prompts and seeds decoded both ways (the unseeded runs seed MLX's
own random state), in-process: drafts accepted per round and tokens
committed per round (accepted + 1), per temperature. Writes JSON too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.targets import target_for

PROMPTS = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "def _check_arg(value, name):\n    if not isinstance(",
    "try:\n    import _thread\nexcept ImportError:\n",
    "for i in range(len(items)):\n",
    "if __name__ == '__main__':\n",
]


def decode(trunk, head, prompt: list[int], params: SamplingParams, n: int, depth: int):
    """(rounds, drafts accepted) of one request decoded at `depth`."""
    plan = Plan("mlx_mtp", "mtp", depth, "spec_on")
    d = SpecDecoder(trunk, MTPProposer(trunk, head), GenerationRequest("b", "m", prompt, params, n, plan),
                    None, 0, None)  # fmt: skip
    step, rounds, accepted = d.prefill(), 0, 0
    while step.finish_reason is None:
        step = d.round(depth)
        rounds, accepted = rounds + 1, accepted + step.stats.accepted
    return rounds, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=4, help="requests per prompt, per rule")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--json", type=Path, default=Path("bench/results/seeded_acceptance.json"))
    args = ap.parse_args()
    path = default_model_path()
    model, config = load_model(path)
    loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
    trunk, head = target_for(model), load_mtp_head(loaded)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in PROMPTS]
    rows = []
    print(f"demo model, MTP depth {args.depth}, {len(prompts)} prompts x {args.seeds} seeds, "
          f"{args.max_tokens} tokens each, device {mx.default_device()}")  # fmt: skip
    print("| temperature | rule | rounds | drafts accepted/round | tokens/round |")
    print("|---:|---|---:|---:|---:|")
    for temperature in map(float, args.temperatures.split(",")):
        for rule in ("rejection (unseeded)", "Gumbel-coupled (seeded)"):
            rounds = accepted = 0
            for i, prompt in enumerate(prompts):
                for s in range(args.seeds):
                    seed = 1000 * i + s
                    if rule.startswith("Gumbel"):
                        params = SamplingParams(temperature=temperature, seed=seed)
                    else:
                        params = SamplingParams(temperature=temperature)
                        mx.random.seed(seed)
                    r, a = decode(trunk, head, prompt, params, args.max_tokens, args.depth)
                    rounds, accepted = rounds + r, accepted + a
            per_round = accepted / rounds
            print(f"| {temperature} | {rule} | {rounds} | {per_round:.3f} | {per_round + 1:.3f} |",
                  flush=True)  # fmt: skip
            rows.append({"temperature": temperature, "rule": rule, "rounds": rounds,
                         "accepted": accepted, "accepted_per_round": per_round})  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"depth": args.depth, "max_tokens": args.max_tokens,
                                     "seeds": args.seeds, "device": str(mx.default_device()),
                                     "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
