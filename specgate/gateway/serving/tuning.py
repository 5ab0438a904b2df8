"""`specgate tune MODEL`, and the measured costs the gateway hands the policy.

kernels/tune.py measures (mlx and mlx-lm only); this wires in the engines'
own decoders, whose rounds it times at every depth, and saves the result
per machine and checkpoint, where `TuneFile` finds it, re-reading it when it
changes (a tune run while the server runs is used by the next request).
A quantized model gets the small-M kernels as the engines do
(kernels/wiring.py, `kernels: auto`): the guard's verdicts for its shapes are
printed, and where any kernel is in use the verify curve is measured both
ways and the kernels' one is saved as the curve the policy reads (the stock
one beside it, for `kernels: off`); rounds are timed through the kernels.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from specgate.engines.home import specgate_home
from specgate.kernels import hook, tune
from specgate.policies.costs import CostModel

log = logging.getLogger(__name__)


class TuneFile:
    """A model's tune results on this machine, re-read when the file changes,
    so `specgate tune` run while the server runs is used by the next request."""

    def __init__(self, model_path: str | Path, kernels: str = "auto", home: Path | None = None):
        # The digest reads the checkpoint's header and sampled blocks: once,
        # not per request.
        self.path = tune.tune_path(model_path, home or specgate_home())
        self.kernels = kernels
        self._seen: tuple | None = None  # what os.stat said of the file last read
        self._costs: CostModel | None = None

    def costs(self) -> CostModel | None:
        """The measured costs (None where the model was never tuned here):
        the verify curve of the path the engines use (`kernels: off` reads the
        stock curve tune measured beside the kernels' one)."""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen = self._costs = None
            return None
        # The inode too: tune.save replaces the file by rename, so a new
        # tune is a new inode even within the filesystem's mtime granularity.
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._seen = seen  # a bad file is not re-read (nor warned of) until it changes
            self._read()
        return self._costs

    def _read(self) -> None:
        try:
            data = tune.read(self.path)
            if self.kernels == "off" and (stock := (data.get("kernels") or {}).get("verify_stock")):
                data = {**data, "verify": stock}
            costs = CostModel.from_measurements(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("tune file %s unreadable (%s): %s", self.path, e,
                        "keeping the costs read before" if self._costs else "no measured costs")  # fmt: skip
            return
        for warning in data["warnings"]:
            log.warning("tune file %s: %s", self.path, warning)
        self._costs = costs


def costs_for(model_path: str | Path, kernels: str = "auto") -> CostModel | None:
    """This model's measured costs on this machine, if `specgate tune` ran."""
    return TuneFile(model_path, kernels).costs()


MAX_TUNED_DEPTH = 8
PROMPT_TOKENS = 64


def _round_timers(loaded, model_path: Path, drafter: str | None, kernels: bool = False,
                  progress=lambda line: None) -> dict[str, tuple]:  # fmt: skip
    """method -> (round_at, depths) for every in-process speculative engine
    (engines/registry.py) this checkpoint, and `drafter`, can run: the engine
    built as the gateway builds it, not started; round_at(k) runs one real
    round of its decoder at depth k, on a fresh sequence per depth (so every
    depth is timed at the same short context), at depths 1..min(its cap,
    MAX_TUNED_DEPTH)."""
    import mlx.core as mx

    from specgate.engines import registry

    # Rounds verify as the engines will: through the kernels where tune wired
    # them, proved for every depth timed (a drafter's own cap where it has one).
    deepest = {r.name: r.settings(depth=MAX_TUNED_DEPTH) for r in registry.records(registry.MLX)
               if r.tune is not None and getattr(r.settings(), "depth", None) is not None}
    context = registry.BuildContext("tune", str(model_path), registry.MLX,
                                    kernels="auto" if kernels else "off", settings=deepest,
                                    drafter=drafter, loaded=loaded)  # fmt: skip
    prompt = mx.random.randint(0, loaded.vocab_size, (PROMPT_TOKENS,), key=mx.random.key(2)).tolist()
    timers: dict[str, tuple] = {}
    timed: list[str] = []
    unread: dict[str, str] = {}  # drafter engines that could not take `drafter`, and why
    for record in registry.records(registry.MLX):
        if (record.tune is None or (record.needs == "drafter" and drafter is None)
                or any(e in timed for e in registry.excludes(record.name))):  # one drafter
            continue
        try:
            engine = record.build(context, (record.name,))[0][record.name]
        except (ValueError, KeyError) as e:  # no MTP head; a drafter of another kind
            if record.needs == "drafter":
                unread[record.name] = str(e)
            else:
                progress(f"{record.method}: not timed ({record.name}: {e})")
            continue
        cap = record.depth_cap(engine) if record.depth_cap else MAX_TUNED_DEPTH
        timers[record.method] = (record.tune(engine, prompt), range(1, min(cap, MAX_TUNED_DEPTH) + 1))
        timed.append(record.name)
    if drafter is not None and not any(registry.record(n).needs == "drafter" for n in timed):
        raise ValueError(f"{drafter}: no engine reads this drafter: "
                         + "; ".join(f"{n}: {why}" for n, why in unread.items()))
    return timers


def _kernels(model, progress):
    """The model's kernel wiring as the engines make it (kernels/wiring.py),
    at every width tune measures; the guard's verdicts for its shapes printed."""
    from specgate.engines import kernel_wiring as wiring  # the guards' verdicts in SPECGATE_HOME

    wired = wiring.prepare(model, "auto", tune.WIDTHS)
    progress(f"kernels: {wired.reason}")
    for v in wired.verdicts() + wired.fused_verdicts():
        progress("  " + wiring.describe(v))
    return wired


def _print_curves(stock: dict, kern: dict, progress) -> None:
    """c(M)/c(1) stock vs through the kernels, per context, side by side."""
    for ctx in stock:
        c1 = stock[ctx][1]
        progress(f"verify c(M)/c(1) at context {ctx} (c(1) {c1 * 1e3:.2f} ms), stock | kernels:")
        for m in stock[ctx]:
            progress(f"  M={m:2d}  {stock[ctx][m] / c1:6.2f} | {kern[ctx][m] / c1:6.2f}")


def run_cli(args) -> int:
    from specgate.gateway.serving.builtins import resolve_builtin  # builtin:demo and friends

    # Resolved to an absolute path when it names a directory here: Path("./m")
    # prints as "m", which mlx-lm would take for a hub repo id.
    given = resolve_builtin(args.model)
    path = Path(given).resolve() if Path(given).exists() else Path(given)
    drafter = resolve_builtin(args.drafter) if args.drafter else None
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f} s] {line}", flush=True)

    from specgate.engines.loading import load_mlx_model

    loaded = load_mlx_model(str(path))
    vocab = loaded.vocab_size
    wired = _kernels(loaded.model, progress)
    if wired.enabled and wired.in_use():
        # Both curves; the one saved as "verify" (what the policy reads) is
        # the one the engines use: through the kernels.
        both = tune.measure_verify(loaded.model, vocab, reps=args.reps, progress=progress,
                                   paths={"stock": lambda: hook.kernels(False),
                                          "kernels": hook.kernels})  # fmt: skip
        stock, verify = both["stock"], both["kernels"]
        _print_curves(stock, verify, progress)
    else:
        stock, verify = None, tune.measure_verify(loaded.model, vocab, reps=args.reps,
                                                  progress=progress)  # fmt: skip
    batched = tune.measure_batched(loaded.model, vocab, reps=args.reps, progress=progress)
    timers = _round_timers(loaded, path, drafter, kernels=wired.enabled, progress=progress)
    rounds = {method: tune.measure_rounds(round_at, depths, reps=args.reps, name=method,
                                          progress=progress)
              for method, (round_at, depths) in timers.items()}  # fmt: skip
    result = tune.measurements(verify, batched, rounds, str(path), kernels={
        "enabled": bool(wired.enabled and wired.in_use()), "why": wired.reason,
        "verdicts": [asdict(v) for v in wired.verdicts()],
        "verify_stock": ({ctx: {m: s / stock[min(stock)][1] for m, s in row.items()}
                          for ctx, row in stock.items()} if stock else None),
    })  # fmt: skip
    for warning in result["warnings"]:
        progress(f"warning: {warning}")
    progress(f"plain step {result['plain_step']:.2f} x c(1); round beyond its verify (x c(1)): "
             + (", ".join(f"{m} {d['per_round']:.2f} + {d['per_token']:.2f} k"
                          for m, d in result["draft"].items()) or "none"))  # fmt: skip
    out = tune.save(result, tune.tune_path(path, specgate_home()))
    print(f"saved {out} in {time.perf_counter() - t0:.0f} s")
    return 0
