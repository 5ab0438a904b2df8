"""Multi-row decode attention on a GPU: correctness, cost curves c(M)/c(1), guard verdicts.

    python bench/verify_attention.py [--home DIR] [--out FILE] [--lengths 1024,4096,16384,32768]
                                     [--dtype bfloat16] [--budget SECONDS]

check:  bench/verify_attention_kernel.py's CUDA kernels against the exact answer (stock
        mx.fast.scaled_dot_product_attention in float32 on the CPU) over
        float16 / bfloat16 / float32, D 64 and 128, plain and GQA, L not a
        multiple of the 32-key tile, M 2..16; error = max over output rows
        of max|y - exact| / max|exact| (the guard's measure), with the bound
        per dtype and the stock path's own error beside it.
curve:  a 7B-class shape (Hq 32, Hkv 8, D 128) at each L: stock
        (`mx.fast.scaled_dot_product_attention(q, k, v, scale, mask="causal")`)
        vs the kernel for M = 1..16 query rows (the kernel from M = 2); each
        time the median of `reps` evals of `calls` calls cycling over enough
        K/V copies (>= 256 MiB) that no call finds its cache in L2, divided
        by `calls`. Ratios are to stock's M = 1 time at that L.
guard:  kernels/guard.py's proof for the CUDA kernel at every (L, M) of the
        curve (verdicts under --home/kernels/<machine>/attention.json).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import verify_attention_kernel as A  # noqa: E402

from specgate.engines.home import kernel_cache_dir  # noqa: E402
from specgate.kernels.guard import TOLERANCE, dtype_name, row_error  # noqa: E402

LINES: list[str] = []
OUT: Path | None = None
T0 = time.time()


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)
    if OUT is not None:
        OUT.write_text("\n".join(LINES) + "\n")


def inputs(hq, hkv, length, m, d, dtype, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, hq, m, d), key=ks[0]).astype(dtype)
    k = mx.random.normal((1, hkv, length, d), key=ks[1]).astype(dtype)
    v = mx.random.normal((1, hkv, length, d), key=ks[2]).astype(dtype)
    mx.eval(q, k, v)
    return q, k, v, 1.0 / math.sqrt(d)


def part_check() -> bool:
    say("== check: CUDA kernel vs exact (stock SDPA, float32, CPU) ==")
    say(f"{'dtype':>8} {'Hq':>3} {'Hkv':>3} {'L':>6} {'M':>3} {'D':>4} | {'kernel err':>10} "
        f"{'emul err':>10} {'stock err':>10} {'bound':>8} | ok")  # fmt: skip
    cases = []
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        for m in (2, 7, 16):
            cases.append((dt, 32, 8, 1000, m, 128))
    cases += [(mx.float16, 8, 8, 333, 3, 64), (mx.float16, 8, 8, 333, 16, 64),
              (mx.bfloat16, 16, 2, 4097, 5, 64), (mx.bfloat16, 32, 8, 33, 16, 128),
              (mx.float32, 4, 1, 2049, 11, 64), (mx.bfloat16, 32, 8, 20001, 4, 128)]  # fmt: skip
    all_ok = True
    for dt, hq, hkv, length, m, d in cases:
        q, k, v, scale = inputs(hq, hkv, length, m, d, dt, seed=length + m)
        exact = A.ATTENTION.exact(q, k, v, scale)
        bound = TOLERANCE[dtype_name(dt)]
        try:
            y = A.cuda_attention(q, k, v, scale)
            mx.eval(y)
            err = row_error(y, exact)
        except Exception as e:  # noqa: BLE001
            say(f"kernel failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            return False
        emu = row_error(A.emulate_attention(q, k, v, scale), exact)
        stock = row_error(A.reference_attention(q, k, v, scale), exact)
        ok = err <= bound
        all_ok &= ok
        say(f"{dtype_name(dt):>8} {hq:>3} {hkv:>3} {length:>6} {m:>3} {d:>4} | {err:>10.2e} "
            f"{emu:>10.2e} {stock:>10.2e} {bound:>8.1e} | {'ok' if ok else 'WRONG'}")  # fmt: skip
    return all_ok


def timed(fn, q, sets, scale, reps, calls):
    def run():
        mx.eval([fn(q, *sets[i % len(sets)], scale) for i in range(calls)])

    run(), run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / calls


def part_curve(lengths, dtype, kernel_ok: bool, reps=5):
    hq, hkv, d = 32, 8, 128
    say(f"\n== curve: Hq {hq}, Hkv {hkv}, D {d}, {dtype_name(dtype)}; c(M)/c(1) vs stock M=1 ==")
    for length in lengths:
        _, k, v, scale = inputs(hq, hkv, length, 1, d, dtype, seed=length)
        per = k.nbytes + v.nbytes
        sets = [(k, v)] + [(k + 0, v + 0) for _ in range(1, min(32, -(-(256 << 20) // per)))]
        mx.eval(sets)
        calls = max(8, len(sets))
        say(f"\nL = {length}: K+V {per / 2**20:.1f} MiB, {len(sets)} copies, {calls} calls a timing")
        say(f"{'M':>3} | {'stock us':>9} {'kernel us':>9} | {'stock c/c1':>10} {'kernel c/c1':>11}"
            f" | {'kernel/stock':>12}")  # fmt: skip
        base = None
        for m in range(1, 17):
            q = mx.random.normal((1, hq, m, d), key=mx.random.key(m)).astype(dtype)
            st = timed(A.reference_attention, q, sets, scale, reps, calls)
            base = base or st
            kt = None
            if kernel_ok and m >= A.MIN_M:
                try:
                    kt = timed(A.cuda_attention, q, sets, scale, reps, calls)
                except Exception as e:  # noqa: BLE001
                    say(f"kernel failed at M={m}: {e}")
            ks = f"{kt * 1e6:>9.1f}" if kt else f"{'-':>9}"
            kr = f"{kt / base:>11.2f}" if kt else f"{'-':>11}"
            rr = f"{kt / st:>12.2f}" if kt else f"{'-':>12}"
            say(f"{m:>3} | {st * 1e6:>9.1f} {ks} | {st / base:>10.2f} {kr} | {rr}")
        del sets, k, v
        mx.clear_cache()


def _cell(x: float | None, fmt: str) -> str:
    return f"{x:>9.{fmt}}" if x is not None else f"{'-':>9}"


def part_guard(lengths, dtype, home, budget):
    say(f"\n== guard: cuda_attention verdicts (Hq 32, Hkv 8, D 128, {dtype_name(dtype)}) ==")
    guard = A.make_guard(candidates=[A.cuda_candidate()], cache_dir=kernel_cache_dir(home))
    say(f"{'L':>6} {'M':>3} | {'status':>7} {'max err':>9} {'bound':>8} {'stock err':>9} | "
        f"{'kernel us':>9} {'stock us':>9}")  # fmt: skip
    for length in lengths:
        for m in range(2, 17):
            if time.time() - T0 > budget:
                say(f"(budget of {budget:.0f} s spent: stopped)")
                return
            v = guard.verdict(guard.candidates[0], m, 32, 8, length, 128, dtype)
            say(f"{length:>6} {m:>3} | {v.status:>7} {_cell(v.max_error, '2e')} {v.bound:>8.1e} "
                f"{_cell(v.reference_error, '2e')} | {_cell(v.kernel_us, '1f')} "
                f"{_cell(v.reference_us, '1f')}"
                + (f"  {v.detail}" if v.detail else ""))  # fmt: skip
    say(f"verdicts: {guard.path}")


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", default="check,curve,guard")
    ap.add_argument("--budget", type=float, default=480.0)
    a = ap.parse_args()
    OUT = Path(a.out) if a.out else None
    lengths = [int(x) for x in a.lengths.split(",")]
    dtype = getattr(mx, a.dtype)
    say(f"mlx {mx.__version__} on {mx.default_device()}; cuda kernel {A.CUDA_VERSION}")
    parts = a.parts.split(",")
    ok = part_check() if "check" in parts else True
    say(f"check: {'all within bound' if ok else 'FAILED'} ({time.time() - T0:.0f} s)")
    if "curve" in parts:
        part_curve(lengths, dtype, ok)
        say(f"({time.time() - T0:.0f} s)")
    if "guard" in parts:
        part_guard(lengths, dtype, Path(a.home) if a.home else None, a.budget)
        say(f"({time.time() - T0:.0f} s)")


if __name__ == "__main__":
    main()
