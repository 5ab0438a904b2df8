"""Measuring, on this machine, the costs the policy's model needs (`specgate tune`).

- verify cost c(M, ctx)/c(1): a forward with logits for every row (what a
  verify computes) over M = 1..16 new tokens after ctx tokens of context, at
  a few context lengths, relative to one token at the shortest;
- plain decoding steps: mlx-lm's BatchGenerator (what the plain engine
  runs) decoding B = 1..8 sequences together, sampling and bookkeeping
  included; B = 1 is the real cost of a plain token, which is more than a
  bare forward (on a small model, much more);
- speculative rounds: whatever round the caller hands in (the engines'
  real decoders, gateway/serving/tuning.py), timed per depth the same way.
After a warm-up per shape (MLX compiles, and on a GPU JITs, each new shape
once), every shape is timed once per pass, passes repeated and the median
kept per shape (`interleaved_medians`). `sanitize` then repairs what noise
makes non-physical (a cost falling as the work grows, a negative cost) and
says so. Results are saved per machine (kernels/machine.py's key: the GPU, driver,
CUDA, CPU and MLX version, not the hostname) and checkpoint digest under
$SPECGATE_HOME/tune/; policies/costs.py reads them.

Only mlx and mlx-lm here: kernels/ sits below the engines.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from specgate.kernels import machine
from specgate.kernels.cache_undo import checkpoint, restore

CONTEXTS = (64, 1024, 4096)
WIDTHS = tuple(range(1, 17))
BATCHES = tuple(range(1, 9))
Progress = Callable[[str], None]


def machine_id() -> str:
    """What this machine's measurements are kept under: its hardware and
    software, never its hostname (kernels/machine.py)."""
    return machine.this_key()


SAMPLE_BLOCKS, BLOCK = 16, 4096
TOLERANCE = 0.02  # repairs smaller than this are timer noise on any machine: made silently


def checkpoint_digest(model_path: str | Path) -> str:
    """What the checkpoint computes, not where it lies: config.json, and per
    safetensors file its name, size, header (every tensor's name, dtype,
    shape, offsets) and 16 blocks of its data at evenly spaced offsets, the
    first and last included. Not a full hash: reading a 100 GB checkpoint
    would take minutes every time a model is served; the sample catches a
    fine-tune or re-quantization of the same layout."""
    model_path = Path(model_path)
    h = hashlib.sha256((model_path / "config.json").read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\n".encode())
        with f.open("rb") as fh:
            header = int.from_bytes(fh.read(8), "little")  # u64 LE: the JSON header's length
            h.update(fh.read(min(header, size)))
            start = 8 + header
            span = max(0, size - start - BLOCK)
            for i in range(SAMPLE_BLOCKS):
                fh.seek(start + span * i // (SAMPLE_BLOCKS - 1))
                h.update(fh.read(BLOCK))
    return h.hexdigest()[:16]


def tune_path(model_path: str | Path, home: Path) -> Path:
    """Where a model's measurements live on this machine: keyed by the
    checkpoint's content, so a copy in another directory shares its tune."""
    return home / "tune" / machine_id() / f"{checkpoint_digest(model_path)}.json"


def interleaved_medians(fns: dict, reps: int = 5) -> dict:
    """Median seconds of each of `fns` over `reps` passes, each pass timing
    every one once, in an order rotated per pass. Timed back to back, a
    burst of load elsewhere (or the machine warming up) lands on whichever
    shape ran then and bends the curve; interleaved, it costs each shape at
    most a sample or two, which the median drops."""
    keys = list(fns)
    for k in keys:
        fns[k]()  # warm-up: each shape compiles once
    samples: dict = {k: [] for k in keys}
    for p in range(max(1, reps)):
        r = p % len(keys)
        for k in keys[r:] + keys[:r]:
            t0 = time.perf_counter()
            fns[k]()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure_verify(model, vocab: int, *, contexts=CONTEXTS, widths=WIDTHS, reps: int = 5,
                   progress: Progress = print, paths: Mapping[str, Callable] | None = None):
    """Seconds of a forward over M tokens after ctx tokens: {ctx: {M: s}}.
    With `paths` (name -> a context manager factory, e.g. kernels off and
    on): {name: {ctx: {M: s}}}, each context prefilled once for all of them
    (the prefill, not the forwards, is most of the time at 4096 tokens)."""
    tokens = mx.random.randint(0, vocab, (max(contexts) + max(widths),), key=mx.random.key(0))
    ways = dict(paths) if paths else {"": nullcontext}
    out: dict[str, dict[int, dict[int, float]]] = {name: {} for name in ways}
    for ctx in contexts:
        cache = make_prompt_cache(model)
        mx.eval(model(tokens[None, :ctx], cache=cache), [c.state for c in cache])

        def forward_at(m, ctx=ctx, cache=cache):
            def forward():
                saved = checkpoint(cache)
                mx.eval(model(tokens[None, ctx : ctx + m], cache=cache))
                restore(cache, saved)
            return forward

        for name, way in ways.items():
            with way():
                row = interleaved_medians({m: forward_at(m) for m in widths}, reps)
            out[name][ctx] = row
            progress(f"{name + ' ' if name else ''}verify at context {ctx}: "
                     + " ".join(f"{m}:{s * 1e3:.1f}" for m, s in row.items()) + " ms")  # fmt: skip
    return out if paths else out[""]


def measure_batched(model, vocab: int, *, batches=BATCHES, context: int = 128, reps: int = 5,
                    progress: Progress = print) -> dict[int, float]:
    """Seconds of one plain decoding step of B sequences after `context`
    tokens each, through BatchGenerator as the plain engine runs it."""
    prompts = mx.random.randint(0, vocab, (max(batches), context), key=mx.random.key(1)).tolist()
    gens = {}  # one generator per batch size, all alive: their steps are interleaved
    for b in batches:
        gen = gens[b] = BatchGenerator(model, completion_batch_size=b, prefill_batch_size=b,
                                       sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))  # fmt: skip
        gen.insert(prompts[:b], max_tokens=[reps + 64] * b)
        while len(gen.next()[1]) < b:  # prefill, until every sequence decodes
            pass
    out = interleaved_medians({b: gen.next for b, gen in gens.items()}, reps)
    for gen in reversed(gens.values()):  # each restores the wired limit the one before it saw
        gen.close()
    progress("plain decoding step: " + " ".join(f"B={b}:{s * 1e3:.1f}" for b, s in out.items())
             + " ms")  # fmt: skip
    return out


def measure_rounds(round_at: Callable[[int], Callable[[], None]], depths, *, reps: int = 5,
                   name: str = "", progress: Progress = print) -> dict[int, float]:
    """Seconds of one speculative round at each depth; `round_at(k)` gives a
    function that runs one round at depth k (all depths' sequences live
    at once: their rounds are interleaved)."""
    out = interleaved_medians({k: round_at(k) for k in depths}, reps)
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
                 rounds: dict[str, dict[int, float]], model_path: str, **extra) -> dict:
    """The saved form: everything relative to c(1), a bare forward over one
    token at the shortest context (raw seconds kept beside, for people and
    for `sanitize`), sanitized, with what sanitize repaired as "warnings"."""
    short = verify[min(verify)]
    c1 = short[1]
    data = {
        "machine": machine_id(), "machine_description": machine.this_machine(), "model": model_path, "measured_at": time.time(),
        "c1_seconds": c1,
        "verify": {ctx: {m: s / c1 for m, s in row.items()} for ctx, row in verify.items()},
        "plain_step": batched[1] / c1,
        "batched": {b: b * batched[1] / s for b, s in batched.items()},
        "batched_seconds": dict(batched),
        "rounds_seconds": rounds,
        "draft": {method: draft_fit(r, short, c1) for method, r in rounds.items()},
        **extra,
    }  # fmt: skip
    clean, warnings = sanitize(data)
    return {**clean, "warnings": warnings}


def _running_max(curve: dict) -> tuple[dict, list[int], float]:
    """curve made non-decreasing in its key (int, or str as read from JSON):
    the keys whose value was raised by more than TOLERANCE, and the largest
    fall, as a share of the value it fell from."""
    out, raised, worst, top = {}, [], 0.0, float("-inf")
    for k in sorted(curve, key=int):
        v = float(curve[k])
        top = max(top, v)
        out[k] = top
        if top > v * (1 + TOLERANCE) and top > 0:
            raised.append(int(k))
            worst = max(worst, 1 - v / top)
    return out, raised, worst


def _clamped_fit(method: str, fit: dict, data: dict) -> tuple[dict, str]:
    """A draft fit with a negative term clamped at 0 and the other refitted
    by least squares with it fixed, from the timed rounds; the message."""
    per_round, per_token = float(fit.get("per_round", 0.0)), float(fit.get("per_token", 0.0))
    bad = "per-token" if per_token < 0 else "per-round"
    was = per_token if per_token < 0 else per_round
    rounds = {int(k): float(s) for k, s in (data.get("rounds_seconds") or {}).get(method, {}).items()}
    short = {int(m): float(c) for m, c in data["verify"][min(data["verify"], key=int)].items()}
    c1 = data.get("c1_seconds")
    ks = [k for k in sorted(rounds) if k + 1 in short]
    if not (ks and c1):
        how = "clamped to 0 (no timed rounds to refit the other term from)"
        per_round, per_token = max(per_round, 0.0), max(per_token, 0.0)
    else:
        extra = [rounds[k] / c1 - short[k + 1] for k in ks]  # beyond the verify, x c(1)
        if per_token < 0:
            per_round, per_token = max(statistics.fmean(extra), 0.0), 0.0
        else:
            slope = sum(k * e for k, e in zip(ks, extra, strict=True)) / sum(k * k for k in ks)
            per_round, per_token = 0.0, max(slope, 0.0)
        how = "refitted with 0"
    msg = (f"{method}: negative {bad} draft cost ({was:.2f} x c(1)): measured noise, {how}; "
           f"now {per_round:.2f} + {per_token:.2f} k")  # fmt: skip
    return {**fit, "per_round": per_round, "per_token": per_token}, msg


def sanitize(data: dict) -> tuple[dict, list[str]]:
    """Tune results with what noise made non-physical repaired, and a message
    per repair saying what was wrong and what was done. Works on the saved
    form, as `measurements` makes it (int keys) or as read back from JSON
    (str keys). Clean data comes back equal, with no messages."""
    out, msgs = copy.deepcopy(data), []

    # Verify: a forward over more tokens cannot cost less.
    curves = [("verify", out.get("verify") or {})]
    if stock := (out.get("kernels") or {}).get("verify_stock"):
        curves.append(("stock verify", stock))
    for what, curve in curves:
        for ctx, row in curve.items():
            curve[ctx], raised, worst = _running_max(row)
            if raised:
                msgs.append(f"{what} at context {ctx}: c(M) fell as M grew at M="
                            f"{', '.join(map(str, raised))} (by up to {worst:.0%}): measured "
                            "noise, raised to the largest c(M) below it")  # fmt: skip

    # Plain steps: a bigger batch cannot take less time per step. Files
    # from before batched_seconds was saved: the seconds follow from the gains.
    if batched := out.get("batched"):
        seconds = out.get("batched_seconds") or {
            b: int(b) * float(out.get("plain_step", 1.0)) * float(out.get("c1_seconds", 1.0)) / float(g)
            for b, g in batched.items()}  # fmt: skip
        repaired, raised, worst = _running_max(seconds)
        if repaired != seconds:
            first = repaired[min(repaired, key=int)]
            out["batched_seconds"] = repaired
            out["batched"] = {b: int(b) * first / s for b, s in repaired.items()}
        if raised:
            msgs.append(f"plain decoding step at B={', '.join(map(str, raised))} took less than "
                        f"at a smaller batch (by up to {worst:.0%}): measured noise, raised to the "
                        "smaller batch's time, batched gains recomputed")  # fmt: skip

    # Draft costs: a drafter cannot give time back.
    for method, fit in (out.get("draft") or {}).items():
        if fit.get("per_round", 0.0) < 0 or fit.get("per_token", 0.0) < 0:
            out["draft"][method], msg = _clamped_fit(method, fit, out)
            msgs.append(msg)

    # plain_step is not checked against 1: a BatchGenerator step may cost
    # less than the bare forward c(1) is timed on (it overlaps a step's graph
    # building with the last one's compute: the demo measured 7.7 vs 11.5 ms).
    return out, msgs


def save(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return path


def read(path: Path) -> dict:
    """A saved tune file, sanitized (files from before sanitize may be
    non-physical): "warnings" holds tune's repairs and any made now.
    Raises OSError or ValueError when the file cannot be used."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("verify"), dict):
        raise ValueError(f"{path}: not a tune file")
    clean, warnings = sanitize(data)
    return {**clean, "warnings": list(data.get("warnings") or []) + warnings}


def load(model_path: str | Path, home: Path) -> dict | None:
    try:
        return read(tune_path(model_path, home))
    except (OSError, ValueError):
        return None
