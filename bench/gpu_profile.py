"""Where a 7B-class verify forward's time goes on a CUDA machine: GPU kernel time vs wall time.

    python bench/gpu_profile.py [--widths 1,2,5,8] [--home DIR] [--out FILE]

MLX has no kernel-level profiler of its own; on the GPU machine PyTorch's
profiler (CUPTI) sees every kernel of the process, MLX's included, so this
bench needs `torch` there (it is a diagnostic, never a dependency of
specgate). The model is bench/verify_curve.py's 4-bit qwen3 (hidden 4096,
28 layers, MLP 12288, vocab 151936, group 64) with a 1024-token cache; per
(width M, mode) it prints:
- wall: one forward with logits for every row, evaluated and undone (the
  median of --reps), and the time spent building its graph in Python;
- gpu: the kernels' summed device time per forward, and the busy time (the
  union of their intervals), so wall - busy is what the host costs;
- the top kernels by device time, with calls per forward and us per call.
Modes: stock (hook off); kernels (kernels/hook.py with the per-linear
guard and the fused guard, verdicts under --home, shared with the other GPU
benches); mma (every quantized linear of 2..16 rows and every sibling group
through the tensor-core kernels, whatever the guard's timing says: what the
guard's choice is compared with). --pyprof: cProfile of one graph build.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify_curve import qwen3_7b  # noqa: E402  (bench/, beside this file)

from specgate.engines.home import kernel_cache_dir  # noqa: E402
from specgate.kernels import hook  # noqa: E402
from specgate.kernels.cache_undo import checkpoint, restore  # noqa: E402
from specgate.kernels.guard import (
    FUSED_QMM,
    Guard,
    cuda_candidate,
    cuda_mma_candidate,
    cuda_mma_fused_candidate,
)

OUT: list = []


def say(s: str = "") -> None:
    print(s, flush=True)
    for f in OUT:
        f.write(s + "\n")
        f.flush()


def kernel_events(trace: Path) -> list[dict]:
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def busy_us(kernels: list[dict]) -> float:
    """Union of the kernels' [ts, ts + dur) intervals."""
    total, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def short(name: str) -> str:
    name = name.split("(")[0]
    return name if len(name) <= 70 else name[:67] + "..."


def cuda_kernels(run):
    """run() under PyTorch's profiler: the CUDA kernels it launched (trace
    events) and what run returned."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as d:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = run()
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return kernel_events(trace), out


def by_name(kernels: list[dict]) -> dict[str, list[float]]:
    """Each kernel's (shortened) name -> its calls' device times (us)."""
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_name[short(e["name"])].append(e["dur"])
    return per_name


def measure(model, cache, tokens, ctx: int, m: int, reps: int, profile_reps: int, pyprof: bool):
    def fwd():
        saved = checkpoint(cache)
        t0 = time.perf_counter()
        out = model(tokens[None, ctx : ctx + m], cache=cache)
        built = time.perf_counter() - t0
        mx.eval(out)
        wall = time.perf_counter() - t0
        restore(cache, saved)
        return built, wall

    for _ in range(3):
        fwd()
    runs = [fwd() for _ in range(reps)]
    built = statistics.median(r[0] for r in runs)
    if pyprof:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        saved = checkpoint(cache)
        pr.enable()
        out = model(tokens[None, ctx : ctx + m], cache=cache)
        pr.disable()
        mx.eval(out)
        restore(cache, saved)
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    wall = statistics.median(r[1] for r in runs)
    ks, _ = cuda_kernels(lambda: [fwd() for _ in range(profile_reps)])
    per_name = by_name(ks)
    return {"built": built, "wall": wall, "sum": sum(e["dur"] for e in ks) / profile_reps,
            "busy": busy_us(ks) / profile_reps, "launches": len(ks) / profile_reps,
            "per_name": per_name}  # fmt: skip


def forced_mma(cache_dir: Path) -> tuple[Guard, Guard]:
    """Guards that enable the tensor-core kernels wherever they are correct
    (nothing recorded: the timing verdict is what this mode overrides)."""
    return (Guard([cuda_mma_candidate()], cache_dir=cache_dir, margin=float("inf"), record=False,
                  reps=1, inner=1, flush_bytes=0),
            Guard([cuda_mma_fused_candidate()], cache_dir=cache_dir, op=FUSED_QMM,
                  margin=float("inf"), record=False, reps=1, inner=1, flush_bytes=0))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1,2,5,8")
    ap.add_argument("--modes", default="stock,kernels")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile-reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--pyprof", action="store_true")
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        OUT.append(a.out.open("w"))
    import torch

    say(f"mlx {mx.__version__} on {mx.default_device()}; torch {torch.__version__}; "
        f"4-bit qwen3 7B-class, {a.layers} layers, {a.ctx}-token cache")  # fmt: skip
    model = qwen3_7b(a.layers, 4096)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    cache = kernel_cache_dir(a.home)
    guard = Guard([cuda_mma_candidate(), cuda_candidate()], cache_dir=cache)
    fused = Guard([cuda_mma_fused_candidate()], cache_dir=cache, op=FUSED_QMM)
    forced = forced_mma(cache)
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.random.randint(0, 151936, (a.ctx + 16,), key=mx.random.key(1))
    cache = make_prompt_cache(model)
    for i in range(0, a.ctx, 256):
        mx.eval(model(tokens[None, i : i + 256], cache=cache), [c.state for c in cache])
    rows = []
    for m in [int(w) for w in a.widths.split(",")]:
        for mode in a.modes.split(","):
            if mode != "stock" and m == 1:
                continue
            hook.install(model, *(forced if mode == "mma" else (guard, fused)))
            t0 = time.perf_counter()
            with hook.kernels(mode != "stock"):
                r = measure(model, cache, tokens, a.ctx, m, a.reps, a.profile_reps,
                            a.pyprof and mode != "stock")  # fmt: skip
            rows.append((m, mode, r))
            say(f"\nM={m} {mode}: wall {r['wall'] * 1e3:.2f} ms (graph built in {r['built'] * 1e3:.2f} ms), "
                f"GPU busy {r['busy'] / 1e3:.2f} ms, kernel sum {r['sum'] / 1e3:.2f} ms, "
                f"{r['launches']:.0f} kernels  [{time.perf_counter() - t0:.0f} s]")  # fmt: skip
            top = sorted(r["per_name"].items(), key=lambda kv: -sum(kv[1]))[: a.top]
            for name, durs in top:
                say(f"   {sum(durs) / a.profile_reps / 1e3:7.3f} ms  {len(durs) / a.profile_reps:5.0f}x "
                    f"{statistics.mean(durs):8.1f} us  {name}")  # fmt: skip
    say("\nguard verdicts (per-linear and fused) at the widths measured:")
    widths = {int(w) for w in a.widths.split(",")}
    for g in (guard, fused):
        for v in g.verdicts().values():
            if v.shape[0] in widths:
                say(f"   {v.kernel:>20} {v.shape} {v.status:>7} kernel {v.kernel_us or 0:.1f} us"
                    f" / stock {v.reference_us or 0:.1f} us")  # fmt: skip
    say("\n  M | mode    | wall ms | built ms | GPU busy ms | host-bound ms (wall - busy) | kernels")
    for m, mode, r in rows:
        say(f"{m:3d} | {mode:7s} | {r['wall'] * 1e3:7.2f} | {r['built'] * 1e3:8.2f} | {r['busy'] / 1e3:11.2f} | "
            f"{r['wall'] * 1e3 - r['busy'] / 1e3:27.2f} | {r['launches']:7.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
