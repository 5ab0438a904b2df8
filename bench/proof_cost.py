"""What a fresh machine's kernel proofs cost, and whether building the
kernels side by side first cuts it (a GPU probe for issue 44's "first
speculative token in seconds").

    python bench/proof_cost.py --mode serial      # the engines' way: kernels/wiring.prove
    python bench/proof_cost.py --mode parallel    # every kernel built first, --threads at once
    python bench/proof_cost.py --tiny             # the same on a small shape

Each run uses a fresh verdict directory, so every verdict is proved again. Run each
mode in its own process with a fresh MLX_PTX_CACHE_DIR: MLX keeps built
kernels in memory and there. Prints the wall time of the proofs (and, in
parallel mode, of the builds before them), and per verdict its whole check
and its first call (Verdict.check_s, first_call_s), summed by kernel.
The model is bench/e2e_mtp_7b.py's 7B-class qwen3 at 4 bits, verify widths
2..5 (a depth-4 round's), as the engines prove them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_mtp_7b import build  # noqa: E402

from specgate.kernels import wiring  # noqa: E402


def build_all(cases: list[tuple], threads: int) -> float:
    """Every candidate's first call at every case, `threads` at once (each
    on its own random inputs): what the proofs would then find built."""

    def one(case):
        guard, cand, shape = case
        if not cand.supports(*shape):
            return
        args = guard.op.inputs(guard.seed, *shape)
        try:
            mx.eval(guard.op.joined(cand.fn(*args)))
        except Exception as e:  # noqa: BLE001 - a kernel that cannot build is the proof's to say
            print(f"  build failed: {cand.name} {shape}: {type(e).__name__}: {e}"[:200])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, cases))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("serial", "parallel"), default="serial")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--widths", default="2,3,4,5")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    shape = dict(hidden=4096, layers=28, mlp=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936)
    if a.tiny:
        shape = dict(hidden=256, layers=2, mlp=768, heads=4, kv_heads=2, head_dim=64, vocab=4096)
    model, _, _ = build(SimpleNamespace(**shape, seed=0, embed_scale=16.0, margin=20.0))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    t0 = time.perf_counter()  # what MLX builds for the model's own ops (a fresh PTX cache: all)
    mx.eval(model(mx.arange(64)[None]))
    first = time.perf_counter() - t0
    widths = tuple(int(w) for w in a.widths.split(","))
    cache = Path(tempfile.mkdtemp(prefix="proof-cost-"))
    guard, fused = wiring.shared_guard(cache), wiring.shared_guard(cache, "qmm_fused")
    print(f"device {mx.default_device()}, mlx {mx.__version__}, mode {a.mode}, widths {widths}; "
          f"the model's first 64-token forward: {first:.1f} s\n"
          f"verdicts keyed {guard.machine} (kernels/machine.py)", flush=True)  # fmt: skip
    built = None
    if a.mode == "parallel":
        cases = [(guard, c, (m, k, n, dt, b, g)) for k, n, dt, b, g in wiring.model_shapes(model)
                 for m in widths for c in guard.candidates]  # fmt: skip
        cases += [(fused, c, (m, k, ns, dt, b, g)) for k, ns, dt, b, g in wiring.group_shapes(model)
                  for m in widths for c in fused.candidates]  # fmt: skip
        built = build_all(cases, a.threads)
        print(f"built {len(cases)} (kernel, shape, width) cases, {a.threads} at once: {built:.1f} s",
              flush=True)  # fmt: skip
    t0 = time.perf_counter()
    wiring.prove(model, "auto", widths, guard=guard, fused_guard=fused)
    proved = time.perf_counter() - t0
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for g in (guard, fused):
        for v in g.verdicts().values():
            row = by_kernel[f"{v.kernel} {v.status}"]
            row[0] += 1
            row[1] += v.check_s or 0.0
            row[2] += v.first_call_s or 0.0
    print(f"\nproofs: {proved:.1f} s" + (f" (after {built:.1f} s of builds)" if built is not None else ""))
    print(f"{'kernel status':32} {'verdicts':>8} {'checks s':>9} {'first calls s':>14}")
    for name, (n, check, first) in sorted(by_kernel.items()):
        print(f"{name:32} {n:8d} {check:9.1f} {first:14.1f}")


if __name__ == "__main__":
    main()
