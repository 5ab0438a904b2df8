"""Measuring, on this machine, the costs the policy's model needs (`specgate tune`).

- verify cost c(M, ctx)/c(1): a forward with logits for every row (what a
  verify computes) over M = 1..16 new tokens after ctx tokens of context, at
  a few context lengths, relative to one token at the shortest;
- batched gain: one decoding step of B = 1..8 sequences together, as
  aggregate tokens/s relative to one sequence;
- drafter costs: whatever drafter step the caller hands in, timed the same way.
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
    """Seconds of one decoding step of B sequences after `context` tokens each."""
    tokens = mx.random.randint(0, vocab, (max(batches), context + 1), key=mx.random.key(1))
    out = {}
    for b in batches:
        cache = make_prompt_cache(model)
        mx.eval(model(tokens[:b, :context], cache=cache), [c.state for c in cache])

        def step(b=b, cache=cache):
            saved = checkpoint(cache)
            mx.eval(model(tokens[:b, context:], cache=cache))
            restore(cache, saved)
        out[b] = median_seconds(step, reps)
    progress("batched step: " + " ".join(f"B={b}:{s * 1e3:.1f}" for b, s in out.items()) + " ms")
    return out


def measurements(verify: dict[int, dict[int, float]], batched: dict[int, float],
                 draft: dict[str, dict[str, float]], model_path: str) -> dict:
    """The saved form: everything relative to c(1) at the shortest context."""
    c1 = verify[min(verify)][1]
    return {
        "machine": machine_id(), "model": model_path, "measured_at": time.time(),
        "c1_seconds": c1,
        "verify": {ctx: {m: s / c1 for m, s in row.items()} for ctx, row in verify.items()},
        "draft": {k: {part: s / c1 for part, s in d.items()} for k, d in draft.items()},
        "batched": {b: b * batched[1] / s for b, s in batched.items()},
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
