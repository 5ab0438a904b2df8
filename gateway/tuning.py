"""`specgate tune MODEL`, and the measured costs the gateway hands the policy.

kernels/tune.py measures (mlx and mlx-lm only); this wires in the engines'
own decoders, whose rounds it times at every depth, and saves the result
per machine and model, where `costs_for` finds it when the model is served.
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


MAX_TUNED_DEPTH = 8
PROMPT_TOKENS = 64


def _round_timers(model_path: Path, drafter: str | None) -> dict[str, tuple]:
    """method -> (round_at, depths): round_at(k) runs one real round of that
    method's decoder at depth k, on a fresh sequence per depth (so every
    depth is timed at the same short context)."""
    import mlx.core as mx

    from engines.base import GenerationRequest, Plan, SamplingParams
    from engines.loading import load_mlx_model
    from engines.mlx_mtp.decoder import MTPDecoder
    from engines.mlx_mtp.loading import load_mtp_head
    from engines.trunk import Trunk

    loaded = load_mlx_model(str(model_path))
    trunk = Trunk(loaded.model)
    prompt = mx.random.randint(0, loaded.vocab_size, (PROMPT_TOKENS,), key=mx.random.key(2)).tolist()
    makers = {}
    try:
        head = load_mtp_head(loaded)
        makers["mtp"] = (lambda request: MTPDecoder(trunk, head, request, None, 0, None),
                         MAX_TUNED_DEPTH)  # fmt: skip
    except ValueError:  # no usable MTP head: nothing to time
        pass
    if drafter is not None:
        from engines.mlx_block.decoder import DFlashDecoder, DSparkDecoder
        from engines.mlx_block.dspark import DSparkDrafter
        from engines.mlx_block.engine import MLXDFlashEngine, MLXDSparkEngine

        try:
            d = MLXDSparkEngine.load_drafter(drafter)
        except (ValueError, KeyError):
            d = MLXDFlashEngine.load_drafter(drafter)
        if isinstance(d, DSparkDrafter):
            makers["dspark"] = (lambda request: DSparkDecoder(trunk, d, request, None, 0, None),
                                d.args.block_size)  # fmt: skip
        else:
            makers["dflash"] = (lambda request: DFlashDecoder(trunk, d, request, None, 0, None),
                                d.args.block_size - 1)  # fmt: skip

    def timer(make):
        def round_at(depth: int):
            request = GenerationRequest("tune", "tune", prompt, SamplingParams(), 1 << 20,
                                        Plan("tune", "none", depth, "spec_on"))  # fmt: skip
            decoder = make(request)
            decoder.prefill()
            return lambda: decoder.round(depth)
        return round_at

    return {m: (timer(make), range(1, depth + 1)) for m, (make, depth) in makers.items()}


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
    rounds = {method: tune.measure_rounds(round_at, depths, reps=args.reps, name=method,
                                          progress=progress)
              for method, (round_at, depths) in _round_timers(path, drafter).items()}  # fmt: skip
    result = tune.measurements(verify, batched, rounds, str(path))
    progress(f"plain step {result['plain_step']:.2f} x c(1); round beyond its verify (x c(1)): "
             + (", ".join(f"{m} {d['per_round']:.2f} + {d['per_token']:.2f} k"
                          for m, d in result["draft"].items()) or "none"))  # fmt: skip
    out = tune.save(result, tune.tune_path(path, specgate_home()))
    print(f"saved {out} in {time.perf_counter() - t0:.0f} s")
    return 0
