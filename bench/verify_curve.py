"""Verify cost curves c(M)/c(1), stock MLX vs specgate's small-M kernels (run on a GPU).

    python bench/verify_curve.py [--part matmul,guard,model] [--home DIR] [--out FILE]

matmul: one (M, 4096) x (4096, N)^T product, N = 12288 and 4096, M = 1..16:
        bf16 (x @ w.T), and 8-bit and 4-bit (group 64) through stock
        mx.quantized_matmul, kernels/qmm.py's CUDA-core kernel (simt) and
        kernels/qmm_mma.py's tensor-core kernel (mma); each
        time is the median of `reps` evals of `calls` products cycling over
        enough weight copies (>= 160 MiB) that no product finds its weights
        in L2, divided by `calls` (so MLX's per-op launch cost is included,
        as in a forward). Ratios are to the stock M=1 time of that precision.
guard:  kernels/guard.py's proof (error vs float32 stock, timing vs stock)
        for both CUDA kernels over bits x group size x dtype at M = 4, and at
        M = 2, 8, 16 for bf16 / group 64, verdicts printed as recorded.
model:  a 7B-class qwen3 (mlx_lm.models.qwen3, random weights: hidden 4096,
        28 layers, 32 heads / 8 KV heads, MLP 12288, vocab 151936), a
        1024-token KV cache, a forward over M = 1..16 new tokens with logits
        for every row (what a verify computes), undone after each timing;
        bf16, 8-bit and 4-bit (nn.quantize, group 64), kernels/hook.py off
        and on (on: every quantized linear of 2..16 rows goes through the
        fastest kernel the guard proved for that shape, else stock).
Tables are printed and, with --out, written to a file; verdicts land under
--home/kernels/<machine>/qmm.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specgate.engines.home import kernel_cache_dir  # noqa: E402
from specgate.kernels import hook, qmm, qmm_mma  # noqa: E402
from specgate.kernels.cache_undo import checkpoint, restore  # noqa: E402
from specgate.kernels.guard import (
    FUSED_QMM,
    Guard,
    cuda_candidate,
    cuda_mma_candidate,
    cuda_mma_fused_candidate,
)

WIDTHS = list(range(1, 17))
LINES: list[str] = []


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)


def timed(fn, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def weight_sets(arrays: tuple, min_bytes: int = 160 << 20) -> list[tuple]:
    nbytes = sum(a.nbytes for a in arrays)
    sets = [arrays] + [tuple(a + mx.zeros((), a.dtype) for a in arrays)
                       for _ in range(-(-min_bytes // nbytes) - 1)]  # fmt: skip
    mx.eval(sets)
    return sets


def per_call(f, x, sets, calls: int, reps: int) -> float:
    def run():
        mx.eval([f(x, *sets[i % len(sets)]) for i in range(calls)])

    return timed(run, reps) / calls


def part_matmul(reps: int, calls: int, gs: int = 64) -> dict:
    k = 4096
    out = {}
    for n in (12288, 4096):
        w = mx.random.normal((n, k), key=mx.random.key(n)).astype(mx.bfloat16) * 0.02
        mx.eval(w)
        res: dict[str, dict[int, float]] = {}
        sets = weight_sets((w,))
        res["bf16"] = {m: per_call(lambda x, w: x @ w.T,
                                   mx.random.normal((m, k)).astype(mx.bfloat16), sets, calls, reps)
                       for m in WIDTHS}  # fmt: skip
        for bits in (8, 4):
            sets = weight_sets(mx.quantize(w, group_size=gs, bits=bits))
            stock, simt, mma = {}, {}, {}
            gpu = mx.default_device() == mx.gpu
            for m in WIDTHS:
                x = mx.random.normal((m, k), key=mx.random.key(m)).astype(mx.bfloat16)
                stock[m] = per_call(lambda x, a, b, c, bits=bits: qmm.reference_qmm(x, a, b, c, gs, bits),
                                    x, sets, calls, reps)  # fmt: skip
                if qmm.supports(m, k, n, x.dtype, bits, gs) and gpu:
                    simt[m] = per_call(lambda x, a, b, c, bits=bits: qmm.cuda_qmm(x, a, b, c, gs, bits),
                                       x, sets, calls, reps)  # fmt: skip
                if qmm_mma.supports(m, k, n, x.dtype, bits, gs) and gpu:
                    mma[m] = per_call(lambda x, a, b, c, bits=bits: qmm_mma.cuda_qmm_mma(x, a, b, c, gs, bits),
                                      x, sets, calls, reps)  # fmt: skip
            res[f"{bits}b stock"], res[f"{bits}b simt"], res[f"{bits}b mma"] = stock, simt, mma
            del sets
            gc.collect()
        out[n] = res
        say(f"\n(a) one product (M, {k}) x ({k}, {n})^T, bf16 activations, group {gs}: "
            f"c(M)/c(1), c(1) in us; kernel and best-of ratios are to stock c(1)")  # fmt: skip
        cols = ["bf16", "8b stock", "8b simt", "8b mma", "8b best", "4b stock", "4b simt", "4b mma",
                "4b best"]
        say("  M | " + " | ".join(f"{c:>9}" for c in cols))
        for m in WIDTHS:
            cells = []
            for c in cols:
                p = c.split()[0]
                base = res["bf16"][1] if p == "bf16" else res[f"{p} stock"][1]
                if c.endswith("best"):
                    v = min(res[f"{p} {s}"].get(m, float("inf")) for s in ("stock", "simt", "mma"))
                else:
                    v = res[c].get(m)
                if v is None:
                    cells.append(f"{'-':>9}")
                elif m == 1 and c.endswith(("bf16", "stock")):
                    cells.append(f"{v * 1e6:7.1f}us")
                else:
                    cells.append(f"{v / base:9.2f}")
            say(f"{m:3d} | " + " | ".join(cells))
        del w
        gc.collect()
    return {str(n): {c: {str(m): v for m, v in r.items()} for c, r in res.items()}
            for n, res in out.items()}  # fmt: skip


def part_guard(guard: Guard) -> list[dict]:
    rows = []
    say("\nguard verdicts (each kernel vs stock; error = max over rows of max|y - exact| / max|exact|,"
        " exact = stock in float32)")  # fmt: skip
    say(f"{'kernel':>12} {'M':>3} {'K':>5} {'N':>6} {'dtype':>8} {'bits':>4} {'gs':>4} {'status':>7} "
        f"{'error':>9} {'bound':>8} {'stock err':>9} {'kernel us':>9} {'stock us':>9}")  # fmt: skip
    grid = [(4, 4096, 4096, dt, bits, gs) for bits in (4, 8) for gs in (32, 64, 128)
            for dt in (mx.bfloat16, mx.float16, mx.float32)]  # fmt: skip
    grid += [(m, 4096, 12288, mx.bfloat16, bits, 64) for bits in (4, 8) for m in (2, 8, 16)]
    for (m, k, n, dt, bits, gs), cand in [(g, c) for g in grid for c in guard.candidates]:
        v = guard.verdict(cand, m, k, n, dt, bits, gs)
        if v is None:
            continue
        rows.append(v.__dict__)

        def f(a, spec="9.2e"):
            return f"{a:{spec}}" if a is not None else f"{'-':>9}"

        say(f"{cand.name:>12} {m:3d} {k:5d} {n:6d} {v.dtype:>8} {bits:4d} {gs:4d} {v.status:>7} {f(v.max_error)} "
            f"{v.bound:8.1e} {f(v.reference_error)} {f(v.kernel_us, '9.1f')} "
            f"{f(v.reference_us, '9.1f')}" + (f"  {v.detail}" if v.detail else ""))  # fmt: skip
    return rows


def qwen3_7b(layers: int, hidden: int):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=3 * hidden, num_attention_heads=hidden // 128,
                           rms_norm_eps=1e-6, vocab_size=151936, num_key_value_heads=min(8, hidden // 128),
                           max_position_embeddings=32768, head_dim=128,
                           tie_word_embeddings=False, rope_theta=1e6)  # fmt: skip
    mx.random.seed(0)
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def forward_curve(model, ctx: int, reps: int) -> dict[int, float]:
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.random.randint(0, 151936, (ctx + 16,), key=mx.random.key(1))
    cache = make_prompt_cache(model)
    for i in range(0, ctx, 256):
        mx.eval(model(tokens[None, i : i + 256], cache=cache), [c.state for c in cache])
    out = {}
    for m in WIDTHS:
        def fwd(m=m):
            saved = checkpoint(cache)
            mx.eval(model(tokens[None, ctx : ctx + m], cache=cache))
            restore(cache, saved)

        out[m] = timed(fwd, reps)
    return out


def part_model(guard: Guard, fused: Guard, layers: int, hidden: int, ctx: int, reps: int, gs: int = 64,
               precisions=("bf16", "8b", "4b")) -> dict:  # fmt: skip
    res = {}
    for prec in precisions:
        t0 = time.perf_counter()
        model = qwen3_7b(layers, hidden)
        if prec != "bf16":
            nn.quantize(model, group_size=gs, bits=int(prec[0]))
            mx.eval(model.parameters())
        res[f"{prec} stock"] = forward_curve(model, ctx, reps)
        if prec != "bf16":
            n = hook.install(model, guard, fused)
            with hook.kernels():
                res[f"{prec} kernel"] = forward_curve(model, ctx, reps)
            say(f"  {prec}: {n} quantized linears hooked; built and measured in "
                f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
        del model
        gc.collect()
        mx.clear_cache()
    nparams = f"hidden {hidden}, {layers} layers, MLP {3 * hidden}, 32/8 heads, vocab 151936"
    say(f"\n(b) qwen3 7B-class forward ({nparams}), {ctx}-token KV cache, M new tokens with "
        f"logits for all: c(M)/c(1), c(1) in ms (kernel: hook on; ratios to stock c(1))")  # fmt: skip
    cols = [c for c in ("bf16 stock", "8b stock", "8b kernel", "4b stock", "4b kernel") if c in res]
    say("  M | " + " | ".join(f"{c:>10}" for c in cols))
    for m in WIDTHS:
        cells = []
        for c in cols:
            v, base = res[c][m], res[c.split()[0] + " stock"][1]
            cells.append(f"{v * 1e3:8.2f}ms" if m == 1 and c.endswith("stock")
                         else f"{v / base:10.2f}")  # fmt: skip
        say(f"{m:3d} | " + " | ".join(cells))
    return {c: {str(m): v for m, v in r.items()} for c, r in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="matmul,guard,model")
    ap.add_argument("--precisions", default="bf16,8b,4b", help="model part: which of bf16,8b,4b")
    ap.add_argument("--max-m", type=int, default=16, help="widths 1..max-m")
    ap.add_argument("--home", type=Path, default=None, help="SPECGATE_HOME for the verdicts")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=11, help="timings per width (median); host jitter is ~+-20 %% a forward")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=1024)
    a = ap.parse_args()
    parts = a.part.split(",")
    say(f"mlx {mx.__version__} on {mx.default_device()}; kernels cuda_qmm@{qmm.CUDA_VERSION}, "
        f"cuda_qmm_mma@{qmm_mma.VERSION}")  # fmt: skip
    guard = Guard([cuda_mma_candidate(), cuda_candidate()], cache_dir=kernel_cache_dir(a.home))
    fused = Guard([cuda_mma_fused_candidate()], cache_dir=kernel_cache_dir(a.home), op=FUSED_QMM)
    WIDTHS[:] = range(1, a.max_m + 1)
    say(f"verdicts: {guard.path}")
    data = {}
    t0 = time.perf_counter()
    if "matmul" in parts:
        data["matmul"] = part_matmul(a.reps, a.calls)
        say(f"[matmul part {time.perf_counter() - t0:.0f} s]")
    if "guard" in parts:
        data["guard"] = part_guard(guard)
        say(f"[guard part {time.perf_counter() - t0:.0f} s]")
    if "model" in parts:
        data["model"] = part_model(guard, fused, a.layers, a.hidden, a.ctx, a.reps,
                                   precisions=a.precisions.split(","))  # fmt: skip
        say(f"[model part {time.perf_counter() - t0:.0f} s; guard checks run: {guard.checks_run}]")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(LINES) + "\n")
    if a.json:
        a.json.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
