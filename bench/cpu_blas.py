"""The demo on a Linux CPU: specgate's float32 through OpenBLAS against mlx-lm, side by side.

    uv run python bench/cpu_blas.py [--reps 5] [--prefill 2048] [--decode 64]

Each repeat runs one fresh process per side, in a rotated order (which BLAS
MLX binds to is decided once per process: specgate/kernels/cpu_blas.py):
- mlx-lm: `mlx_lm.load` and `generate_step` alone, as a user of mlx-lm runs
  the demo checkpoint (bfloat16, MLX's own CPU loops and the wheel's BLAS);
- specgate: the model as specgate loads it to serve (`load_mlx_model`:
  float32 through OpenBLAS where the machine has it);
- specgate, SPECGATE_SYSTEM_BLAS=0: the same load without OpenBLAS.
Prefill is the prompt in 512-token chunks (the CPU's prefill step); decode
is `generate_step`'s greedy tokens after it. Prints tokens/s and each
side's ratio over mlx-lm, median [min, max] over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIDES = {  # name -> (environment, whether the child imports specgate first)
    "mlx-lm": ({}, False),
    "specgate": ({}, True),
    "specgate, SPECGATE_SYSTEM_BLAS=0": ({"SPECGATE_SYSTEM_BLAS": "0"}, True),
}


def child(side: str, prefill: int, decode: int) -> dict:
    """One side's measurement in this process (run by `main` in a fresh one)."""
    _, with_specgate = SIDES[side]
    if with_specgate:
        import specgate  # noqa: F401  (first: it binds MLX's BLAS before MLX loads)
        from specgate.engines.checkpoints.builtin import default_model_path
        from specgate.engines.loading import load_mlx_model

        model = load_mlx_model(str(default_model_path())).model
    else:
        import importlib.util
        from pathlib import Path

        import mlx_lm

        spec = importlib.util.find_spec("specgate")  # its files only: not imported
        demo = Path(spec.origin).parent / "engines" / "checkpoints" / "demo"
        model, _ = mlx_lm.load(str(demo))
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    dtypes = sorted(
        {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())}
    )
    prompt = mx.array([(i * 7919) % 4000 + 10 for i in range(prefill)])
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for i in range(0, prefill, 512):
        mx.eval(model(prompt[None, i : i + 512], cache=cache), [c.state for c in cache])
    prefill_s = time.perf_counter() - start
    steps = generate_step(prompt[-1:], model, max_tokens=decode, prompt_cache=cache)
    next(steps)  # the first token: its step is prefill's tail
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": prefill / prefill_s, "decode_tok_s": n / decode_s, "dtypes": dtypes}


def run_side(side: str, prefill: int, decode: int) -> dict:
    env, _ = SIDES[side]
    done = subprocess.run([sys.executable, __file__, "--child", side, "--prefill", str(prefill),
                           "--decode", str(decode)], capture_output=True, text=True,
                          env=os.environ | env, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{side}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.prefill, args.decode)))
        return 0
    names = list(SIDES)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            r = run_side(name, args.prefill, args.decode)
            got[name].append(r)
            print(f"  repeat {rep + 1}, {name} ({', '.join(r['dtypes'])}): prefill "
                  f"{r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s", flush=True)  # fmt: skip
    base = got["mlx-lm"]
    print(f"\n## the demo on this CPU ({args.reps} repeats, prefill {args.prefill} tokens, "
          f"decode {args.decode}; median [min, max], ratios per repeat over mlx-lm)")  # fmt: skip
    print("side | prefill tok/s | decode tok/s | prefill / mlx-lm | decode / mlx-lm")
    for name in names:
        rows = got[name]
        ratio = {
            k: [r[k] / b[k] for r, b in zip(rows, base, strict=True)]
            for k in ("prefill_tok_s", "decode_tok_s")
        }
        print(f"{name} | {summary([r['prefill_tok_s'] for r in rows])} | "
              f"{summary([r['decode_tok_s'] for r in rows])} | {summary(ratio['prefill_tok_s'])} | "
              f"{summary(ratio['decode_tok_s'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
