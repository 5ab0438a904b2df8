"""`specgate tune MODEL`, and the measured costs the gateway hands the policy.

kernels/tune.py measures (mlx and mlx-lm only); this wires in the engines'
drafters, whose step it times too, and saves the result per machine and
model, where `costs_for` finds it when the model is served.
"""

from __future__ import annotations

import time
from pathlib import Path

from engines.checkpoints.default_model import specgate_home
from kernels import tune
from policies.costs import CostModel


def costs_for(model_path: str | Path) -> CostModel | None:
    """This model's measured costs on this machine, if `specgate tune` ran."""
    data = tune.load(model_path, specgate_home())
    return CostModel.from_measurements(data) if data else None


def _drafter_steps(model_path: Path, drafter: str | None, reps: int) -> dict[str, dict[str, float]]:
    """Seconds of each drafter's step: an MTP head step per draft, a block pass per round."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from engines.loading import load_mlx_model
    from engines.mlx_mtp.loading import load_mtp_head
    from engines.trunk import Trunk

    loaded = load_mlx_model(str(model_path))
    trunk = Trunk(loaded.model)
    out: dict[str, dict[str, float]] = {}
    try:
        head = load_mtp_head(loaded)
    except Exception:  # noqa: BLE001 - no usable MTP head: nothing to time
        head = None
    if head is not None:
        h, e = mx.zeros((1, 1, trunk.hidden_size)), trunk.embed(mx.array([[1]]))

        def head_step():
            mx.eval(trunk.logits(head(e, h, [KVCache() for _ in head.layers])))
        out["mtp"] = {"per_token": tune.median_seconds(head_step, reps)}
    if drafter is not None:
        from engines.mlx_block.engine import MLXDFlashEngine, MLXDSparkEngine

        for cls in (MLXDSparkEngine, MLXDFlashEngine):
            try:
                d = cls.load_drafter(drafter)
                break
            except (ValueError, KeyError):
                continue
        a = d.args
        feats = mx.zeros((1, 64, len(a.target_layer_ids) * trunk.hidden_size))
        block = trunk.embed(mx.array([[1] + [a.mask_token_id] * (a.block_size - 1)]))

        def block_pass():
            mx.eval(trunk.logits(d(block, feats, d.make_cache())))
        method = "dspark" if cls is MLXDSparkEngine else "dflash"
        out[method] = {"per_round": tune.median_seconds(block_pass, reps)}
    return out


def run_cli(args) -> int:
    from gateway.models import resolve_path  # builtin:demo and friends

    path = Path(resolve_path(args.model))
    drafter = resolve_path(args.drafter) if args.drafter else None
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f} s] {line}", flush=True)

    from engines.loading import load_mlx_model

    loaded = load_mlx_model(str(path))
    vocab = loaded.vocab_size
    verify = tune.measure_verify(loaded.model, vocab, reps=args.reps, progress=progress)
    batched = tune.measure_batched(loaded.model, vocab, reps=args.reps, progress=progress)
    draft = _drafter_steps(path, drafter, args.reps)
    result = tune.measurements(verify, batched, draft, str(path))
    progress("drafters (x c(1)): " + (", ".join(f"{k} {v}" for k, v in result["draft"].items())
                                      or "none"))  # fmt: skip
    out = tune.save(result, tune.tune_path(path, specgate_home()))
    print(f"saved {out} in {time.perf_counter() - t0:.0f} s")
    return 0
