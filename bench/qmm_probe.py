"""Tensor-core small-M kernel on a GPU: correctness at a spread of shapes, then
time per product (stock / CUDA-core kernel / tensor-core kernel, and the
tensor-core kernel's launch configurations) at the 7B shapes.

    python bench/qmm_probe.py [--sweep]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify_curve import per_call, weight_sets  # noqa: E402  (bench/, beside this file)

from specgate.kernels import qmm, qmm_mma  # noqa: E402
from specgate.kernels.guard import TOLERANCE, dtype_name, row_error  # noqa: E402


def inputs(m, k, n, dt, bits, gs, seed=0):
    k1, k2 = mx.random.split(mx.random.key(seed + m + k + n))
    w = mx.random.normal((n, k), key=k1).astype(dt)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.random.normal((m, k), key=k2).astype(dt)
    mx.eval(x, wq, s, b)
    return x, wq, s, b


def correctness() -> bool:
    ok = True
    grid = [(m, 4096, 1003, mx.bfloat16, 4, 64) for m in (1, 3, 8, 9, 16)]
    grid += [(5, 4096, 1024, mx.float16, 4, 32), (4, 4096, 2048, mx.bfloat16, 8, 128),
             (12, 4096, 520, mx.float16, 8, 64), (2, 12288, 4096, mx.bfloat16, 4, 128),
             (7, 256, 24, mx.bfloat16, 8, 32)]  # fmt: skip
    print("correctness: error = max over rows of max|y - exact| / max|exact| (exact: stock in f32)")
    for m, k, n, dt, bits, gs in grid:
        x, wq, s, b = inputs(m, k, n, dt, bits, gs)
        f = mx.float32
        exact = qmm.reference_qmm(x.astype(f), wq, s.astype(f), b.astype(f), gs, bits)
        t0 = time.perf_counter()
        try:
            y = qmm_mma.cuda_qmm_mma(x, wq, s, b, gs, bits)
            mx.eval(y)
            err = row_error(y, exact)
        except Exception as e:  # noqa: BLE001
            print(f"  M={m:2d} K={k} N={n} {dtype_name(dt)} {bits}b g{gs}: FAILED {e}")
            ok = False
            continue
        stock = row_error(qmm.reference_qmm(x, wq, s, b, gs, bits), exact)
        bound = TOLERANCE[dtype_name(dt)]
        good = err <= bound
        ok &= good
        print(f"  M={m:2d} K={k:5d} N={n:5d} {dtype_name(dt):>8} {bits}b g{gs:<3d}: error {err:.2e} "
              f"(stock {stock:.2e}, bound {bound:.1e}) {'ok' if good else 'WRONG'} "
              f"[{time.perf_counter() - t0:.1f} s incl. compile]")  # fmt: skip
    return ok


def timing(sweep: bool) -> None:
    shapes = [(4096, 12288), (12288, 4096), (4096, 4096), (4096, 1024), (4096, 151936)]
    for bits in (4, 8):
        print(
            f"\n{bits}-bit g64 bf16: us per product (TB/s of weight bytes), L2 flushed by weight copies"
        )
        print(f"{'K':>6} {'N':>6} {'M':>3} | {'stock':>16} | {'simt':>16} | {'mma':>16} | cfg")
        for k, n in shapes:
            _, wq, s, b = inputs(1, k, n, mx.bfloat16, bits, 64)
            nbytes = wq.nbytes + s.nbytes + b.nbytes
            sets = weight_sets((wq, s, b), 200 << 20)
            for m in (1, 2, 4, 8, 16):
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                cells = []
                for name, fn in (("stock", qmm.reference_qmm), ("simt", qmm.cuda_qmm),
                                 ("mma", qmm_mma.cuda_qmm_mma)):  # fmt: skip
                    if name == "simt" and not qmm.supports(m, k, n, x.dtype, bits, 64):
                        cells.append(f"{'-':>16}")
                        continue
                    t = per_call(lambda x, a, b_, c, fn=fn, bits=bits: fn(x, a, b_, c, 64, bits),
                                 x, sets, calls=24, reps=7)  # fmt: skip
                    cells.append(f"{t * 1e6:8.1f} ({nbytes / t / 1e12:4.2f})")
                w, nt = qmm_mma.launch_config(m, k, n, bits)
                print(
                    f"{k:6d} {n:6d} {m:3d} | " + " | ".join(cells) + f" | W{w} NT{nt}", flush=True
                )
                if sweep and m in (4,) and n != 151936:
                    alts = []
                    for w in (1, 2, 4, 8):
                        for nt in (1, 2, 4):
                            t = per_call(lambda x, a, b_, c, w=w, nt=nt, bits=bits: qmm_mma.cuda_qmm_mma(
                                x, a, b_, c, 64, bits, w=w, nt=nt), x, sets, calls=16, reps=5)  # fmt: skip
                            alts.append(f"W{w}NT{nt}={t * 1e6:.1f}")
                    print("        sweep M=4: " + " ".join(alts), flush=True)
            del sets


def overhead() -> None:
    """Host time per call: building the graph node, then evaluating 2000 of them
    (a 4096 x 1024 product, M = 4, where the GPU work is small)."""
    k, n = 4096, 1024
    x, wq, s, b = inputs(4, k, n, mx.bfloat16, 4, 64)
    print("\nhost cost per call (4096 x 1024, M = 4): build the graph node | evaluate")
    for name, fn in (
        ("stock", qmm.reference_qmm),
        ("simt", qmm.cuda_qmm),
        ("mma", qmm_mma.cuda_qmm_mma),
    ):
        mx.eval(fn(x, wq, s, b, 64, 4))
        t0 = time.perf_counter()
        ys = [fn(x, wq, s, b, 64, 4) for _ in range(2000)]
        t1 = time.perf_counter()
        mx.eval(ys)
        t2 = time.perf_counter()
        print(f"  {name:>5}: {(t1 - t0) / 2000 * 1e6:6.2f} us | {(t2 - t1) / 2000 * 1e6:6.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}; cuda_qmm_mma@{qmm_mma.VERSION}")
    t0 = time.perf_counter()
    good = correctness()
    print(f"[correctness {'all ok' if good else 'FAILURES'} in {time.perf_counter() - t0:.0f} s]")
    overhead()
    if not a.no_timing:
        timing(a.sweep)
        print(f"[timing done at {time.perf_counter() - t0:.0f} s]")


if __name__ == "__main__":
    main()
