"""How good is the demo model's MTP head? Held-out perplexity and acceptance.

    uv run python bench/mtp_acceptance.py [--model DIR] [--tokens N] [--json PATH]

On held-out Python standard-library files (never trained on; the model
directory's heldout_files.json names them), teacher-forced in windows:
- trunk perplexity;
- greedy MTP acceptance at depth 1: at each position i the head, given the
  trunk's hidden state at i and the true token i+1, drafts token i+2; the
  draft counts as accepted when it equals the trunk's own greedy prediction
  after token i+1 (what a depth-1 speculative round would accept);
Goal (issue 3): acceptance at least 0.5.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specgate.builders.demo_training import evaluate, load_demo
from specgate.builders.tokenizer import ENDOFTEXT
from specgate.engines.checkpoints.builtin import default_model_path


def heldout_tokens(model_dir: Path, limit: int) -> tuple[np.ndarray, list[str]]:
    names = json.loads((model_dir / "heldout_files.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eot = tok.token_to_id(ENDOFTEXT)
    paths = [stdlib / n for n in names if (stdlib / n).is_file()]  # versions differ
    per_file = max(512, limit // max(1, len(paths)))  # spread over files, not one big one
    ids, used = [], []
    for path in paths:
        ids += tok.encode(path.read_text(encoding="utf-8", errors="replace")).ids[:per_file] + [eot]
        used.append(str(path.relative_to(stdlib)))
        if len(ids) >= limit:
            break
    return np.array(ids[:limit], dtype=np.int64), used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the shipped demo model")
    parser.add_argument("--tokens", type=int, default=30_000)
    parser.add_argument("--json", type=Path, default=Path("bench/results/mtp_acceptance.json"))
    args = parser.parse_args()
    model_dir = args.model or default_model_path()
    tokens, files = heldout_tokens(model_dir, args.tokens)
    model = load_demo(model_dir)
    t0 = time.perf_counter()
    ev = evaluate(model, tokens)
    seconds = time.perf_counter() - t0
    print(f"model {model_dir}")
    print(f"held-out: {len(files)} stdlib files, {ev.tokens:,} tokens ({seconds:.0f} s)")
    print("metric                         | value  | goal")
    print("-------------------------------+--------+------")
    print(f"trunk perplexity               | {ev.trunk_perplexity:6.2f} |")
    verdict = "PASS" if ev.mtp_acceptance >= 0.5 else "MISS"
    print(f"MTP acceptance, depth 1, greedy| {ev.mtp_acceptance:6.3f} | >= 0.5 {verdict}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": str(model_dir), "files": files, "tokens": ev.tokens,
                                     "trunk_perplexity": ev.trunk_perplexity,
                                     "mtp_acceptance": ev.mtp_acceptance}, indent=2))


if __name__ == "__main__":
    main()
