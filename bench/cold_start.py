"""A fresh machine's first answers: how long after its engines start a model
serves plain, and speculates through the proved kernels (issue 44: the first
speculative token <= 20 s, plain answers from the first second).

    python bench/cold_start.py [--modes parallel,serial,restart] [--reps 1] [--depth 4]
    python bench/cold_start.py --tiny --modes parallel    # the same path on a CPU

Each run is a process of its own with a new SPECGATE_HOME and a new, empty
MLX_PTX_CACHE_DIR, so nothing MLX or the guard built before is found: a fresh
machine. Modes:
- serial:   every kernel built where it is first called, one at a time
            (kernel_wiring.build_workers = 0: specgate before
            kernels/prebuild.py);
- parallel: the product's way: kernels/prebuild.py's worker processes build
            MLX's prompt tiles and the proofs' references side by side, and
            compile ours into MLX's cache (kernels/nvrtc.py); prompts go
            without a tile not built yet (kernels/tiles.py);
- restart:  a second process on the home the repeat's last fresh run left
            (its verdicts, MLX's kernels and ours in the cache).
In a run: the target (bench/gpu_suite.py's 4-bit 7B-shape qwen3 with the
bigram path and an MTP head, random weights) is built in memory, prepared
as loading prepares what it serves (prepare_for_decoding, then
kernel_wiring.prebuild_forward as load_mlx_model calls it), and then the
plain engine and the MTP SpecEngine (oracle drafts at --accept) start on it,
as the registry starts them. Time 0 is that start. Then, one after the
other:
- a plain request (--prompt tokens, --tokens new): its first token (its
  answer is what the MTP request drafts from and must equal);
- plain requests every second while the MTP engine proves: the slowest
  TTFT among them;
- once the MTP engine has switched to its kernels (kernel_proofs.py), a
  request held to MTP at --depth: when its first speculative round's
  tokens came (the first speculative token), and that its output equals
  the plain engine's;
- when the plain engine's batch steps took the kernels (up to --deadline).
Prints a table of seconds per run and mode, median [min, max] over --reps.
--json keeps, per run, what says where the time went: MLX's kernel cache's
module count each 5 s, every module with the second it appeared, and each
thread's spans of 1 s or more in one place (sampled four times a second).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_suite import summary  # noqa: E402 - median [min, max]

MODES = ("parallel", "serial", "restart")
COLUMNS = ("target built", "first plain token", "slowest plain TTFT while proving",
           "MTP kernels on", "its first token (prefill)", "first speculative token",
           "plain batch kernels on")  # fmt: skip


def child(a) -> dict:
    """One fresh run (this process's environment names fresh caches)."""
    t_start = time.perf_counter()
    import mlx.core as mx
    from gpu_suite import OracleSpecEngine, PlainEngine, bigram_target, loaded_model, prompts_for

    from specgate.engines import kernel_wiring
    from specgate.engines.base import RoundStats, TokenEvent
    from specgate.engines.loading import prepare_for_decoding

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(relativeCreated)8.0f ms %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("specgate").setLevel(logging.INFO)
    kernel_wiring.build_workers = 0 if a.child == "serial" else None  # (restart: as parallel)
    out: dict = {}

    def save() -> None:  # after each milestone: a run cut short still reports what it reached
        a.result.write_text(json.dumps(out))

    model, head, vocab = bigram_target(a)
    prepare_for_decoding(model)
    out["target built"] = time.perf_counter() - t_start
    t0 = time.perf_counter()
    timeline: list[tuple[float, int]] = []  # (s, modules in MLX's kernel cache): who built what when
    threading.Thread(target=watch_cache, args=(t0, timeline), daemon=True).start()
    spans: list[list] = []  # [thread, where, from s, to s]: what each thread waited in
    threading.Thread(target=sample_threads, args=(t0, spans), daemon=True).start()
    kernel_wiring.prebuild_forward(model)  # as load_mlx_model does
    loaded = loaded_model(model, vocab)
    plain = PlainEngine(model, vocab, max_concurrent=8, loaded=loaded, wait=False, kernels=a.plain_kernels)
    spec = OracleSpecEngine(model, head, vocab, a.accept, a.depth, a.seed, loaded=loaded)
    spec.depth = a.depth
    switch = spec.engine.kernel_switch
    # When each engine's kernels are decided, as it happens (not when this
    # loop next looks): the MTP engine's lone widths, the plain engine's batches.
    decided: dict[str, float] = {}
    for key, event in (("MTP", switch.done), ("plain", plain.engine.batch_kernels.done)):
        threading.Thread(target=stamp, args=(event, key, t0, decided), daemon=True).start()
    rng = random.Random(a.seed)
    prompt = prompts_for(rng, vocab, a.prompt, 1)[0]
    # The first plain request's answer is also what the MTP request's oracle
    # drafts from (and what its output must equal): one request, not two,
    # ahead of the first speculative one.
    first = plain.one(prompt, a.tokens)
    out["first plain token"] = first.times[0] - t0
    spec.refs[tuple(prompt)] = first.tokens
    save()
    ttfts = []
    while not switch.done.is_set() and time.perf_counter() - t0 < a.deadline:
        t = time.perf_counter()
        ttfts.append(plain.one(prompts_for(rng, vocab, a.prompt, 1)[0], 4).ttft)
        switch.done.wait(max(0.0, 1.0 - (time.perf_counter() - t)))
    out["slowest plain TTFT while proving"] = max(ttfts) if ttfts else None
    out["plain requests while proving"] = len(ttfts)
    # Where no kernel builds (a CPU) the engine verifies stock: its first
    # speculative token is still timed, with "MTP kernels on" empty.
    out["MTP kernels on"] = decided.get("MTP") if spec.engine.target.kernels else None
    save()

    async def first_spec():
        request, planner = spec.request("cold-spec", prompt, a.tokens)
        tokens, when = [], None
        out["speculative request sent"] = time.perf_counter() - t0
        async for event in spec.engine.generate(request, planner):
            if isinstance(event, TokenEvent) and event.token_ids:
                if not tokens:
                    out["its first token (prefill)"] = time.perf_counter() - t0
                tokens += event.token_ids
            elif isinstance(event, RoundStats) and event.drafted and when is None:
                when = time.perf_counter() - t0
        return tokens, when

    if switch.done.is_set():
        tokens, out["first speculative token"] = spec.loop.run_until_complete(first_spec())
        out["exact"] = tokens == spec.refs[tuple(prompt)]
        save()
    if plain.engine.kernels_ready(max(0.0, a.deadline - (time.perf_counter() - t0))):
        out["plain batch kernels on"] = decided.get("plain") if plain.engine.batch_kernels.on else None
    b = kernel_wiring.builder()
    out["build workers"] = 0 if b is None else b.workers
    guard = kernel_wiring.shared_guard()
    out["machine key"] = guard.machine
    out["verdicts"] = {k: v.status for op in ("qmm", "qmm_fused")
                       for k, v in kernel_wiring.shared_guard(op).verdicts().items()}  # fmt: skip
    out["device"] = str(mx.default_device())
    out["kernel cache timeline"] = timeline[::5]
    out["thread spans"] = [x for x in spans if x[3] - x[2] >= 1.0]
    out["modules"] = modules(t0)
    save()
    spec.close()
    plain.close()
    return out


def stamp(event: threading.Event, key: str, t0: float, decided: dict) -> None:
    """decided[key]: the second after t0 at which `event` was set."""
    event.wait()
    decided[key] = time.perf_counter() - t0


def watch_cache(t0: float, timeline: list) -> None:
    """Modules in MLX's kernel cache, each second (the workers' private
    directories, .build-*, not counted)."""
    ptx = Path(os.environ["MLX_PTX_CACHE_DIR"])
    while True:
        timeline.append((round(time.perf_counter() - t0, 1), len(list(ptx.glob("*.ptx")))))
        time.sleep(1.0)


def sample_threads(t0: float, spans: list) -> None:
    """Where each thread of this process is, four times a second, as spans
    of unchanged place: the innermost frame, and the innermost two of
    specgate's, mlx-lm's or this bench's. A thread inside a native call (an
    eval building kernels) shows the Python line that called it."""
    me = threading.get_ident()
    ours = ("specgate" + os.sep, "mlx_lm" + os.sep, "bench" + os.sep)
    last: dict[int, list] = {}
    while True:
        now = round(time.perf_counter() - t0, 2)
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack = []
            f = frame
            while f is not None:
                stack.append(f)
                f = f.f_back
            mine = [x for x in stack if any(o in x.f_code.co_filename for o in ours)][:2]
            where = " < ".join(f"{Path(x.f_code.co_filename).name}:{x.f_code.co_name}:{x.f_lineno}"
                               for x in [stack[0], *mine])  # fmt: skip
            span = last.get(ident)
            if span is not None and span[1] == where:
                span[3] = now
            else:
                span = last[ident] = [names.get(ident, str(ident)), where, now, now]
                spans.append(span)
        time.sleep(0.25)


def modules(t0: float) -> list:
    """MLX's kernel cache at the end: each module's name, when (s after t0)
    its .ptx appeared, and its link count (2: a worker's, handed over)."""
    ptx = Path(os.environ["MLX_PTX_CACHE_DIR"])
    now_wall, now = time.time(), time.perf_counter() - t0
    out = []
    for p in ptx.glob("*.ptx"):
        st = p.stat()
        out.append([p.stem, round(now - (now_wall - st.st_mtime), 1), st.st_nlink])
    return sorted(out, key=lambda x: x[1])


def run_child(a, mode: str, tmp: Path) -> dict:
    """One run in a process of its own, its home and MLX kernel cache in
    `tmp` (new for a fresh run; a fresh run's, for a restart)."""
    env = dict(os.environ, SPECGATE_HOME=str(tmp / "home"), MLX_PTX_CACHE_DIR=str(tmp / "ptx"),
               PYTHONUNBUFFERED="1")  # fmt: skip
    result = tmp / f"result-{mode}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--result", str(result),
           *a.passthrough]  # fmt: skip
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env=env, timeout=a.deadline + 300).returncode
    except subprocess.TimeoutExpired:  # (killed: what it saved still counts)
        rc = "timed out"
    if not result.exists():
        print(f"[{mode}] run failed (exit {rc}), nothing saved", flush=True)
        return {}
    out = json.loads(result.read_text())
    if rc != 0:
        out["incomplete"] = f"exit {rc}"
    brief = {k: v for k, v in out.items()
             if k not in ("verdicts", "kernel cache timeline", "thread spans", "modules")}  # fmt: skip
    print(f"[{mode}] {json.dumps(brief)} ({time.perf_counter() - t:.0f} s)", flush=True)
    return out


def one_rep(a, modes: list[str]) -> dict[str, dict]:
    """Each mode once; a restart on the home the fresh run before it left."""
    out: dict[str, dict] = {}
    homes: list[Path] = []
    try:
        for mode in modes:
            if mode == "restart":
                if not homes:
                    print("[restart] skipped: no fresh run before it in this repeat", flush=True)
                    continue
                out[mode] = run_child(a, mode, homes[-1])
            else:
                homes.append(Path(tempfile.mkdtemp(prefix="cold-start-")))
                out[mode] = run_child(a, mode, homes[-1])
    finally:
        for tmp in homes:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="parallel,serial",
                    help=f"of {', '.join(MODES)} (restart: a second process on the home the last "
                         "fresh run left: its verdicts and MLX's kernels recorded)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="a small shape (a CPU check)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=400.0, help="seconds a run waits at most")
    ap.add_argument("--plain-kernels", default="auto", choices=("auto", "off"),
                    help="the plain engine's batch kernels (off: its proofs do not run beside)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.shape = "tiny" if a.tiny else "7b"
    a.modes = [m for m in a.modes.split(",") if m]
    if not a.modes or not set(a.modes) <= set(MODES):
        ap.error(f"--modes takes {', '.join(MODES)}")
    a.passthrough = [f"--depth={a.depth}", f"--accept={a.accept}", f"--prompt={a.prompt}",
                     f"--tokens={a.tokens}", f"--seed={a.seed}", f"--deadline={a.deadline}",
                     f"--plain-kernels={a.plain_kernels}",
                     *(["--tiny"] if a.tiny else [])]  # fmt: skip
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.child:
        child(a)
        return 0
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    fresh = [m for m in a.modes if m != "restart"]
    for rep in range(a.reps):
        order = fresh if rep % 2 == 0 else fresh[::-1]  # (a restart goes last: on the last fresh run's home)
        for mode, out in one_rep(a, order + ["restart"] * ("restart" in a.modes)).items():
            runs[mode].append(out)
    print(f"\n## cold start: seconds after the engines start ({a.shape} shape, 4-bit; MTP depth {a.depth}, "
          f"a = {a.accept}; {a.reps} run(s) per mode, median [min, max])\n")  # fmt: skip
    print("| mode | " + " | ".join(COLUMNS) + " | exact | workers |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for mode, rs in runs.items():
        cells = [summary([r[c] for r in rs if isinstance(r.get(c), (int, float))], ".1f")
                 for c in COLUMNS]  # fmt: skip
        exact = ", ".join(str(r.get("exact", "-")) for r in rs)
        workers = ", ".join(str(r.get("build workers", "-")) for r in rs)
        print(f"| {mode} | " + " | ".join(cells) + f" | {exact} | {workers} |")
    every = [r for rs in runs.values() for r in rs if r.get("verdicts")]
    print(f"\nmachine keys: {sorted({r.get('machine key') for r in every})}")
    for r in every[1:]:  # the same machine, proved afresh: the same verdicts?
        first = every[0]["verdicts"]
        both = set(first) & set(r["verdicts"])
        differ = sorted(k for k in both if first[k] != r["verdicts"][k])
        print(f"verdicts against the first run's: {len(both) - len(differ)} of {len(both)} the same"
              + (f"; differ: {differ[:8]}" if differ else ""))  # fmt: skip
    for mode, rs in runs.items():  # where the time went: each thread's longest waits
        for i, r in enumerate(rs):
            spans = sorted(r.get("thread spans", []), key=lambda s: s[3] - s[2], reverse=True)[:12]
            if spans:
                print(f"\n{mode} #{i + 1}: the longest spans in one place (s after the start; thread; where)")
                for name, where, t0, t1 in sorted(spans, key=lambda s: s[2]):
                    print(f"  {t0:6.1f}-{t1:6.1f} {name[:24]:24s} {where[:140]}")
    if a.json:
        a.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    from mlx_exit import end_process

    end_process(main())
