"""On a CUDA machine: do our kernels compiled ahead (specgate/kernels/nvrtc.py)
reach MLX, and are they the kernels MLX would have built?

    python bench/device/nvrtc_check.py [--json out.json]

Two processes, each with a fresh MLX_PTX_CACHE_DIR, run the same launches
(the per-linear kernel, the tensor-core kernel, the fused one; 7B shapes):
- "mlx": MLX builds each at its first call. The text MLX generates
  (verbose=True, its stdout captured) is compared with Launch.mlx_text();
- "ours": the builder's processes compile them all side by side first
  (kernels/prebuild.py, Job kind "ours"); then each
  first call is timed (a cache hit takes milliseconds, a build seconds).
Prints, per launch: text equal, MLX's build, the first call after the
seeding, and whether both processes' outputs are equal bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [("qmm", 4, 4096, 4096), ("mma", 5, 4096, 4096), ("mma", 5, 4096, 12288),
          ("mma", 5, 12288, 4096), ("fused", 5, 4096, (4096, 1024, 1024)), ("fused", 5, 4096, (12288, 12288))]  # fmt: skip


def _inputs(k, ns, dtype):
    import mlx.core as mx

    mx.random.seed(0)
    parts = []
    for n in ns if isinstance(ns, tuple) else (ns,):
        w = mx.random.normal((n, k)).astype(dtype)
        parts.append(mx.quantize(w, group_size=64, bits=4))
    return parts


def _call(kind, m, k, ns, verbose=False):
    """The launch's output, through the same kernel object and launch
    arguments the product uses (verbose: MLX prints its text)."""
    import mlx.core as mx

    from specgate.kernels import qmm, qmm_mma

    dtype = mx.bfloat16
    x = mx.random.normal((m, k), key=mx.random.key(1)).astype(dtype)
    parts = _inputs(k, ns, dtype)
    if kind == "qmm":
        wq, s, b = parts[0]
        template, w, cpl = qmm._template("cuda", m, k, ns, dtype, s.dtype, 4, 64)
        return qmm._kernel("cuda")(inputs=[x, wq, s, b], template=template,
                                   grid=(-(-ns // (32 * cpl)) * w * 32, 1, 1), threadgroup=(w * 32, 1, 1),
                                   output_shapes=[(m, ns)], output_dtypes=[dtype], verbose=verbose)  # fmt: skip
    if kind == "mma":
        wq, s, b = parts[0]
        qmm_mma.cuda_qmm_mma(x, wq, s, b, 64, 4)  # (fills the launch arguments' cache)
        (launch,) = [v for key, v in qmm_mma._launches.items() if key[2] == wq.shape]
        return qmm_mma._kernel()(inputs=[x, wq, s, b], **launch, verbose=verbose)
    flat = [a for p in parts for a in p]
    qmm_mma.cuda_qmm_mma_fused(x, *flat, 64, 4)
    (launch,) = [v for key, v in qmm_mma._launches.items() if key[2] == tuple(a.shape for a in flat)]
    return qmm_mma._kernel(len(parts))(inputs=[x, *flat], **launch, verbose=verbose)


def _launch(kind, m, k, ns):
    import mlx.core as mx

    from specgate.kernels import qmm, qmm_mma

    if kind == "qmm":
        return qmm.cuda_launch(m, k, ns, mx.bfloat16, 4, 64)
    return qmm_mma.cuda_launch(m, k, ns, mx.bfloat16, 4, 64)


def _captured(fn):
    """What C++ writes to stdout during fn(), and fn's result."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            out = fn()
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace"), out


def child(mode: str, out_dir: Path) -> dict:
    import mlx.core as mx
    import numpy as np

    from specgate.kernels import nvrtc

    rows = []
    seeded = None
    if mode == "ours":
        from specgate.kernels.prebuild import Builder, Job

        arch = str(mx.device_info()["architecture"])
        ptx = Path(os.environ["MLX_PTX_CACHE_DIR"])
        ptx.mkdir(parents=True, exist_ok=True)
        b = Builder(ptx, 8, arch=arch)
        r = b.build([Job("qmm", "ours", (i,), _launch(*s), arch) for i, s in enumerate(SHAPES)])
        b.close()
        seeded = {"compiled": r.modules, "failed": r.failed, "seconds": round(r.seconds, 2),
                  "errors": r.errors[:3], "nvrtc": nvrtc.nvrtc().version}  # fmt: skip
    for i, shape in enumerate(SHAPES):
        launch = _launch(*shape)
        t = time.perf_counter()
        if mode == "mlx":
            text, ys = _captured(lambda s=shape: _call(*s, verbose=True))
        else:
            text, ys = "", _call(*shape)
        mx.eval(ys)
        first = time.perf_counter() - t
        got = text.split("```\n", 1)[1].rsplit("\n```", 1)[0] if "```" in text else ""
        np.save(out_dir / f"{mode}-{i}.npy", np.concatenate([np.array(y.astype(mx.float32)).ravel() for y in ys]))
        rows.append({"shape": str(shape), "first_call_s": round(first, 3),
                     "text_equal": got == launch.mlx_text() if mode == "mlx" else None,
                     "name_in_text": (f"`{launch.kernel_name}`" in text) if mode == "mlx" else None})  # fmt: skip
        if mode == "mlx" and got != launch.mlx_text():
            (out_dir / f"mlx-text-{i}.cu").write_text(got)
            (out_dir / f"our-text-{i}.cu").write_text(launch.mlx_text())
    return {"rows": rows, "seeded": seeded}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=("mlx", "ours"))
    ap.add_argument("--dir", type=Path)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.dir)))
        return 0
    import numpy as np

    tmp = Path(tempfile.mkdtemp(prefix="nvrtc-check-"))
    results = {}
    for mode in ("mlx", "ours"):
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp / f"ptx-{mode}"))
        p = subprocess.run([sys.executable, __file__, "--child", mode, "--dir", str(tmp)], env=env,
                           capture_output=True, text=True, timeout=900)  # fmt: skip
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-3000:])
            return 1
        results[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"seeding: {results['ours']['seeded']}")
    print(f"{'launch':<44} {'text = MLX':>10} {'MLX build s':>12} {'after seed s':>13} {'bitwise':>8}")
    ok = True
    for i, shape in enumerate(SHAPES):
        m, o = results["mlx"]["rows"][i], results["ours"]["rows"][i]
        same = bool(np.array_equal(np.load(tmp / f"mlx-{i}.npy"), np.load(tmp / f"ours-{i}.npy")))
        ok &= bool(m["text_equal"]) and same
        print(f"{str(shape):<44} {str(m['text_equal']):>10} {m['first_call_s']:>12.3f} {o['first_call_s']:>13.3f} "
              f"{str(same):>8}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    print("all equal" if ok else f"DIFFERENCES (texts kept in {tmp})")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
