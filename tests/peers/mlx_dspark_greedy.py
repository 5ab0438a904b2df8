"""Greedy token ids from mlx-dspark's own generation loops (run by ITS venv's python).

    PY=$(uv run python tests/peers/mlx_dspark_env.py)
    $PY tests/peers/mlx_dspark_greedy.py --target T --drafter D --prompts p.json \
        --max-tokens 32 --mode dflash [--block-size K] [--max-draft M]

p.json: [[ids...], ...] (token ids, no text). Prints one JSON object on stdout:
{"outputs": [[ids...], ...], "stats": [...], "info": {...}}; everything the library
prints goes to stderr.

What is mlx-dspark's and what is ours:
- baseline = `mlx_dspark.greedy_generate`, dflash = `mlx_dspark.dflash_generate`, both
  called with `prompt_ids=` (the ids go in untouched: no chat template, no BOS is added;
  see generate.py `ids = prompt_ids if prompt_ids is not None else encode_prompt(...)`).
- temperature 0: argmax (generate.py `_sample_arr` / `_pick`); the dflash verify is an
  exact argmax match (generate.py, fused greedy path of dflash_generate).
- EOS is ignored by replacing `mlx_dspark.generate.eos_token_ids` (the only source of the
  loops' stop set) with an empty set, so each loop runs to its token budget.
- dflash commits whole rounds (`while len(out_ids) < max_new_tokens`, up to block_size
  tokens per round) and so may return up to block_size - 1 extra tokens; they are cut to
  exactly --max-tokens here (the raw count is in stats).
- the drafter is loaded unquantized (`load_dflash(quantize=False)`; the CLI default is
  4-bit, `--drafter-bits 4`), in the checkpoint's dtype; the target as mlx-lm loads it.
- draft length: the drafter always drafts block_size - 1 tokens per round; --block-size
  overrides the config's block_size, --max-draft caps how many of them are verified
  (mlx-dspark's `max_draft_tokens`; default: all, z-lab's operating point. The CLI would
  instead pick a machine-measured cap via calibrate.static_cap).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--mode", choices=("baseline", "dflash"), required=True)
    ap.add_argument("--block-size", type=int, help="override the drafter's block_size")
    ap.add_argument("--max-draft", type=int, help="verify at most this many drafted tokens")
    args = ap.parse_args(argv)
    if args.mode == "dflash" and not args.drafter:
        ap.error("--mode dflash needs --drafter")
    with open(args.prompts) as f:
        prompts = json.load(f)
    if not (isinstance(prompts, list) and all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
        ap.error("--prompts must hold a JSON list of non-empty token-id lists")

    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON answer
        import mlx.core as mx
        import mlx_dspark
        import mlx_dspark.generate as gen
        from mlx.utils import tree_flatten
        from mlx_dspark.load import load_dflash, load_target

        gen.eos_token_ids = lambda tokenizer: set()  # ignore EOS: run to the budget
        target, tok = load_target(args.target, require_tap=args.mode == "dflash")
        drafter = None
        if args.mode == "dflash":
            drafter, cfg = load_dflash(args.drafter, quantize=False)
            if args.block_size:
                cfg.block_size = args.block_size
            drafter.bind(target.model)
        info = {
            "mlx_dspark": mlx_dspark.__version__,
            "mlx": mx.__version__,
            "target_dtype": str(tree_flatten(target.model.parameters())[0][1].dtype),
            "hybrid": target.is_hybrid,
        }
        if drafter is not None:
            info |= {
                "block_size": int(drafter.config.block_size),
                "mask_token_id": int(drafter.config.mask_token_id),
                "target_layer_ids": list(drafter.config.target_layer_ids),
                "drafter_dtype": str(drafter.fc.weight.dtype),
            }
        outputs, stats = [], []
        for ids in prompts:
            if args.mode == "baseline":
                res = gen.greedy_generate(target, tok, prompt_ids=list(ids),
                                          max_new_tokens=args.max_tokens, temperature=0.0)
            else:
                res = gen.dflash_generate(target, tok, drafter, prompt_ids=list(ids),
                                          max_new_tokens=args.max_tokens,
                                          max_draft_tokens=args.max_draft, temperature=0.0)
            outputs.append([int(t) for t in res.token_ids[: args.max_tokens]])
            stats.append({"raw_tokens": res.num_tokens, "rounds": res.num_rounds,
                          "accept_lengths": res.accept_lengths,
                          "finish_reason": res.finish_reason})
    print(json.dumps({"outputs": outputs, "stats": stats, "info": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
