"""Measuring, on this machine, the costs the policy's model needs (`specgate tune`).

- verify cost c(M, ctx)/c(1): a forward with logits for every row (what a
  verify computes) over M = 1..16 new tokens after ctx tokens of context, at
  a few context lengths, relative to one token at the shortest;
- plain decoding steps: mlx-lm's BatchGenerator (what the plain engine
  runs) decoding B = 1..8 sequences together, sampling and bookkeeping
  included; B = 1 is the real cost of a plain token, which is more than a
  bare forward (on a small model, much more);
- speculative rounds: whatever round the caller hands in (the engines'
  real decoders, gateway/tuning.py), timed per depth the same way.
Medians of a few repetitions after a warm-up per shape (MLX compiles, and on
a GPU JITs, each new shape once). Results are saved per machine and model
under $SPECGATE_HOME/tune/; policies/costs.py reads them.

Only mlx and mlx-lm here: kernels/ sits below the engines.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from kernels.cache_undo import checkpoint, restore

CONTEXTS = (64, 1024, 4096)
WIDTHS = tuple(range(1, 17))
BATCHES = tuple(range(1, 9))
Progress = Callable[[str], None]


def machine_id() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "", f"{platform.node() or 'host'}-{mx.default_device()}")


def tune_path(model_path: str | Path, home: Path) -> Path:
    """Where a model's measurements live on this machine (keyed by its config and weights)."""
    model_path = Path(model_path)
    h = hashlib.sha256((model_path / "config.json").read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return home / "tune" / machine_id() / f"{model_path.name}-{h.hexdigest()[:12]}.json"


def median_seconds(fn: Callable[[], None], reps: int = 5) -> float:
    fn()  # warm-up: this shape compiles once
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_verify(model, vocab: int, *, contexts=CONTEXTS, widths=WIDTHS, reps: int = 5,
                   progress: Progress = print) -> dict[int, dict[int, float]]:
    """Seconds of a forward over M tokens after ctx tokens: {ctx: {M: s}}."""
    tokens = mx.random.randint(0, vocab, (max(contexts) + max(widths),), key=mx.random.key(0))
    out: dict[int, dict[int, float]] = {}
    for ctx in contexts:
        cache = make_prompt_cache(model)
        mx.eval(model(tokens[None, :ctx], cache=cache), [c.state for c in cache])
        row = {}
        for m in widths:
            def forward(m=m, ctx=ctx, cache=cache):
                saved = checkpoint(cache)
                mx.eval(model(tokens[None, ctx : ctx + m], cache=cache))
                restore(cache, saved)
            row[m] = median_seconds(forward, reps)
        out[ctx] = row
        progress(f"verify at context {ctx}: " + " ".join(f"{m}:{s * 1e3:.1f}" for m, s in row.items())
                 + " ms")  # fmt: skip
    return out


def measure_batched(model, vocab: int, *, batches=BATCHES, context: int = 128, reps: int = 5,
                    progress: Progress = print) -> dict[int, float]:
    """Seconds of one plain decoding step of B sequences after `context`
    tokens each, through BatchGenerator as the plain engine runs it."""
    prompts = mx.random.randint(0, vocab, (max(batches), context), key=mx.random.key(1)).tolist()
    out = {}
    for b in batches:
        gen = BatchGenerator(model, completion_batch_size=b, prefill_batch_size=b,
                             sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))  # fmt: skip
        gen.insert(prompts[:b], max_tokens=[reps + 64] * b)
        while len(gen.next()[1]) < b:  # prefill, until every sequence decodes
            pass
        out[b] = median_seconds(gen.next, reps)
        gen.close()
    progress("plain decoding step: " + " ".join(f"B={b}:{s * 1e3:.1f}" for b, s in out.items())
             + " ms")  # fmt: skip
    return out


def measure_rounds(round_at: Callable[[int], Callable[[], None]], depths, *, reps: int = 5,
                   name: str = "", progress: Progress = print) -> dict[int, float]:
    """Seconds of one speculative round at each depth; `round_at(k)` gives a
    function that runs one round at depth k."""
    out = {k: median_seconds(round_at(k), reps) for k in depths}
    progress(f"{name} round: " + " ".join(f"{k}:{s * 1e3:.1f}" for k, s in out.items()) + " ms")
    return out


def draft_fit(rounds: dict[int, float], verify_short: dict[int, float], c1: float) -> dict:
    """What a round costs beyond its verify forward, per_round + per_token * k
    in units of c(1), least squares over the measured depths: the drafter,
    and every fixed cost a round pays (sampling, acceptance, rollback)."""
    ks = sorted(rounds)
    extra = [rounds[k] / c1 - verify_short[k + 1] / c1 for k in ks]
    if len(ks) == 1:
        return {"per_round": extra[0], "per_token": 0.0}
    mk, me = statistics.fmean(ks), statistics.fmean(extra)
    slope = (sum((k - mk) * (e - me) for k, e in zip(ks, extra, strict=True))
             / sum((k - mk) ** 2 for k in ks))  # fmt: skip
    return {"per_round": me - slope * mk, "per_token": slope}


def measurements(verify: dict[int, dict[int, float]], batched: dict[int, float],
                 rounds: dict[str, dict[int, float]], model_path: str) -> dict:
    """The saved form: everything relative to c(1), a bare forward over one
    token at the shortest context (raw seconds kept beside, for people)."""
    short = verify[min(verify)]
    c1 = short[1]
    return {
        "machine": machine_id(), "model": model_path, "measured_at": time.time(),
        "c1_seconds": c1,
        "verify": {ctx: {m: s / c1 for m, s in row.items()} for ctx, row in verify.items()},
        "plain_step": batched[1] / c1,
        "batched": {b: b * batched[1] / s for b, s in batched.items()},
        "rounds_seconds": rounds,
        "draft": {method: draft_fit(r, short, c1) for method, r in rounds.items()},
    }


def save(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return path


def load(model_path: str | Path, home: Path) -> dict | None:
    try:
        return json.loads(tune_path(model_path, home).read_text())
    except (OSError, ValueError):
        return None
