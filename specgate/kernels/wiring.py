"""Wiring the small-M kernels into an engine's verify forward, at load.

`prepare(model, setting, widths, cache_dir=...)` is what an engine (through
engines/kernel_wiring.py, as `specgate tune` does; bench/e2e_mtp_7b.py with
guards of its own) calls once when it loads a model:

- `setting` "off", or a model with no affine 4/8-bit `QuantizedLinear`:
  nothing is installed, verify forwards stay stock.
- each kernel of the guard is probed once at the model's first shape
  (M = 2): a kernel that cannot be built on this device (CUDA code on a
  CPU or a Mac, Metal code off Apple silicon, a compile error) gets its
  `failed` verdict, recorded in the cache like any other, and is
  dropped for this process, so no later shape tries it again. If none is
  left, the hook is not installed: one log line, the stock path.
- otherwise the guard proves every (shape, width) the engine can verify
  (`widths`, M = 2..max depth+1; an lm_head, hook.WIDE_N, at one row too:
  the MTP head's drafts), so no proof lands inside a live request
  (verdicts on disk are read back, not re-proved), and kernels/hook.py is
  installed on the model. Widths beyond these are proved at their first use.
  `prove` runs the proofs alone, installing nothing, off an engine's load
  path (engines/mlx_spec/kernel_proofs.py); inside guard.recorded_only(),
  `prepare` proves nothing and raises Unproved where a verdict is missing.
- sibling groups (a layer's q/k/v and gate/up, hook.FUSE_GROUPS) get the
  fused tensor-core kernel through a second guard (guard.FUSED_QMM), proved
  the same way per (group shape, width); where it is refused or cannot
  build, each linear takes its own path as above.
- the engine then runs each round's verify forward inside
  `hook.kernels(wired.enabled)` (the plain engine: its batch steps, whose
  prompt chunks of 2..16 rows are routed too, every width proved for
  them); a speculative engine's prefill and one-row steps are never routed.

One guard per verdict cache directory per process (`shared_guard`), so
engines that share a model share verdicts and its log lines. The directory
comes from the caller (the engines: $SPECGATE_HOME/kernels, engines/home.py):
kernels/ reads no environment for it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import mlx.nn as nn

from specgate.kernels import guard as guards
from specgate.kernels import hook, nvrtc, qmm
from specgate.kernels.guard import FUSED_QMM, Guard, Verdict, cuda_mma_fused_candidate, dtype_name
from specgate.kernels.prebuild import Builder, Job
from specgate.kernels.tiles import TILE_ROWS

log = logging.getLogger("specgate.kernels")

SETTINGS = ("auto", "off")

_guards: dict[tuple[Path, str], Guard] = {}
_guards_lock = threading.Lock()


def shared_guard(cache_dir: Path, op: str = "qmm") -> Guard:
    """This process's guard for the verdicts in `cache_dir`: the default
    kernels ("qmm"), or the fused sibling-linear kernel ("qmm_fused")."""
    key = (Path(cache_dir), op)
    with _guards_lock:
        if key not in _guards:
            _guards[key] = (Guard(cache_dir=key[0]) if op == "qmm" else Guard(
                [cuda_mma_fused_candidate()], cache_dir=key[0], op=FUSED_QMM))  # fmt: skip
        return _guards[key]


Shape = tuple  # (K, N, dtype, bits, group_size)


def model_shapes(model: nn.Module) -> list[Shape]:
    """Distinct (K, N, activation dtype, bits, group size) of the model's
    hookable quantized linears, in first-met order."""
    out: dict[Shape, None] = {}
    for _, m in model.named_modules():
        if hook.eligible(m):
            n, words = m["weight"].shape
            out[(words * 32 // m.bits, n, m["scales"].dtype, m.bits, m.group_size)] = None
    return list(out)


@dataclass
class Wiring:
    """What `prepare` decided for one model."""

    enabled: bool  # verify forwards run inside hook.kernels()
    reason: str  # one line, for logs and `specgate tune`
    guard: Guard | None = None
    shapes: list[Shape] = field(default_factory=list)
    widths: tuple[int, ...] = ()
    hooked: int = 0  # quantized linears routed through the hook
    failed: dict[str, str] = field(default_factory=dict)  # kernel -> why it cannot build here
    fused_guard: Guard | None = None  # proves sibling groups (q/k/v, gate/up) in one launch
    groups: list[tuple] = field(default_factory=list)  # their shapes (K, Ns, dtype, bits, gs)

    def verdicts(self) -> list[Verdict]:
        """The recorded verdicts for this model's shapes at its widths (every usable kernel)."""
        if self.guard is None:
            return []
        out = []
        for k, n, dtype, bits, gs in self.shapes:
            for m in self.widths:
                for cand in self.guard.candidates:
                    v = self.guard.verdict(cand, m, k, n, dtype, bits, gs)
                    if v is not None:
                        out.append(v)
        return out

    def fused_verdicts(self) -> list[Verdict]:
        """The recorded verdicts for its sibling groups at its widths."""
        if self.fused_guard is None:
            return []
        return [v for k, ns, dtype, bits, gs in self.groups for m in self.widths
                for cand in self.fused_guard.candidates
                if (v := self.fused_guard.verdict(cand, m, k, ns, dtype, bits, gs)) is not None]  # fmt: skip

    def in_use(self) -> int:
        """(shape, width) pairs where some kernel is enabled."""
        return len({(tuple(v.shape), v.dtype, v.bits, v.group_size) for v in self.verdicts() if v.ok})


def group_shapes(model: nn.Module) -> list[tuple]:
    """Distinct (K, (N0, N1[, N2]), dtype, bits, group size) of the model's
    sibling groups (hook.FUSE_GROUPS), in first-met order."""
    out: dict[tuple, None] = {}
    for group in hook.fuse_groups(model):
        m = group[0]
        k = m["weight"].shape[1] * 32 // m.bits
        out[(k, tuple(g["weight"].shape[0] for g in group), m["scales"].dtype, m.bits, m.group_size)] = None
    return list(out)


def _usable(guard: Guard, shapes: list[Shape],
            stop: threading.Event | None = None) -> tuple[list, dict[str, str]] | None:  # fmt: skip
    """The guard's kernels that build on this device (probed at the first
    shape they are written for, M = 2), and why the others do not. A kernel
    written for none of the model's shapes (e.g. tensor cores at float32)
    is dropped without a word. None: `stop` was set before a probe."""
    keep, failed = [], {}
    for cand in guard.candidates:
        if stop is not None and stop.is_set():
            return None
        v = None
        for k, n, dtype, bits, gs in shapes:
            v = guard.verdict(cand, qmm.MIN_M, k, n, dtype, bits, gs)
            if v is not None:
                break
        if v is not None and v.status == "failed":
            failed[cand.name] = v.detail or "failed"
        elif v is not None:
            keep.append(cand)
    return keep, failed


@dataclass
class _Proved:
    """What `_prove` found: the kernels that build here and every verdict
    they need, recorded (prepare installs from it)."""

    guard: Guard
    fused_guard: Guard | None
    shapes: list[Shape]
    widths: tuple[int, ...]
    keep: list
    failed: dict[str, str]
    groups: list[tuple]
    fused_ok: int


def _cases(guard: Guard, keep: list, shapes: list[Shape], fused_guard: Guard | None, fused_keep: list,
           groups: list[tuple], widths: tuple[int, ...], one_row: bool):  # fmt: skip
    """(guard, candidate, shape) of every verdict a model's wiring reads:
    every kernel at every shape and width (an lm_head, hook.WIDE_N, and with
    `one_row` every shape, at one row too), then every sibling group's.
    Shape by shape, the widths inside: the order the builds are spread in
    (kernels/prebuild.py)."""
    for k, n, dtype, bits, gs in shapes:
        for m in (1, *widths) if (one_row or n >= hook.WIDE_N) and widths else widths:
            for cand in keep:
                yield guard, cand, (m, k, n, dtype, bits, gs)
    for k, ns, dtype, bits, gs in groups:
        for m in (1, *widths) if one_row and widths else widths:
            for cand in fused_keep:
                yield fused_guard, cand, (m, k, ns, dtype, bits, gs)


def _build_first(builder: Builder, guard: Guard, shapes: list[Shape], fused_guard: Guard | None,
                 widths: tuple[int, ...], one_row: bool, model: nn.Module,
                 stop: threading.Event | None, urgent: bool) -> None:  # fmt: skip
    """What the proofs below would wait for MLX to build, built side by side
    first (kernels/prebuild.py; `urgent`: ahead of what is queued): the
    stock op and the float32 reference every unrecorded verdict compares
    with, where they are MLX's tiles (TILE_ROWS rows up), each shape once.

    Not our kernels themselves: MLX keeps a custom kernel out of its disk
    cache (it reads one there, but never writes it), so a worker's build
    of one never reaches this process (`_seed` has ours compiled there).
    On an H100 the workers built 0 modules for a speculative engine's
    widths 2..5 (46 jobs, 13-44 s spent before its proofs), and 7 for the
    plain engine's 108: MLX's tiles at 9-16 rows, ~27 s each, most of
    those proofs' 225 s."""
    def live(g: Guard | None) -> list:
        return [] if g is None else [c for c in g.candidates
                                     if c.name not in g.dropped and guards.backend_present(c.name)]  # fmt: skip

    fused = live(fused_guard)
    groups = group_shapes(model) if fused else []
    jobs = []
    for g, cand, shape in _cases(guard, live(guard), shapes, fused_guard, fused, groups, widths, one_row):
        m, k, ns, dtype, bits, gs = shape
        if m < TILE_ROWS or not cand.supports(*shape) or g.recorded(cand, *shape):
            continue
        for n in ns if isinstance(ns, tuple) else (ns,):  # (a group: each part's product)
            jobs.append(Job(guards.QMM.name, "reference", (m, k, n, dtype_name(dtype), bits, gs)))
    if not jobs:
        return
    report = builder.build(jobs, stop, urgent=urgent)
    slowest = ", ".join(f"M={j.shape[0]} K={j.shape[1]} N={j.shape[2]} {t:.1f} s" for t, j in report.slowest[:3])
    log.info("kernels: the proofs' references built side by side: %d of %d jobs (%d modules) in %.1f s "
             "on up to %d processes%s%s", report.built, len(set(jobs)), report.modules, report.seconds,
             builder.workers, f" ({report.failed} failed there: built here instead)" if report.failed else "",
             f"; slowest {slowest}" if slowest else "")  # fmt: skip


def _seed(builder: Builder, guard: Guard, shapes: list[Shape], fused_guard: Guard | None,
          widths: tuple[int, ...], one_row: bool, model: nn.Module, stop: threading.Event | None,
          urgent: bool) -> None:  # fmt: skip
    """Our CUDA kernels at every width the wiring will launch them (the
    verdicts to prove, those recorded ok, and `_usable`'s probe), compiled
    into MLX's cache by the builder's processes first (kernels/nvrtc.py):
    neither the proofs nor the first rounds wait for MLX to build them one
    at a time, and a restart finds them built."""
    def live(g: Guard | None) -> list:
        return [] if g is None else [c for c in g.candidates if c.launch is not None and c.name not in g.dropped
                                     and guards.backend_present(c.name)]  # fmt: skip

    fused = live(fused_guard)
    groups = group_shapes(model) if fused else []
    cases = []
    for cand in live(guard):  # `_usable`'s probe, at the first shape it is written for
        probe = next(((qmm.MIN_M, *s) for s in shapes if cand.supports(qmm.MIN_M, *s)), None)
        if probe is not None:
            cases.append((guard, cand, probe))
    cases += _cases(guard, live(guard), shapes, fused_guard, fused, groups, widths, one_row)
    jobs, before = [], 0
    for g, cand, shape in cases:
        if not cand.supports(*shape) or g.recorded_ok(cand, *shape) is False:
            continue
        launch = cand.launch(*shape)
        if nvrtc.cached(builder.ptx_dir, launch):
            before += 1
            continue
        m, k, ns, dtype, bits, gs = shape
        jobs.append(Job(g.op.name, "ours", (m, k, ns, dtype_name(dtype), bits, gs), launch, builder.arch))
    if not jobs:
        return
    report = builder.build(jobs, stop, urgent=urgent)
    log.info("kernels: %d of ours compiled side by side in %.1f s on up to %d processes (%d built before)%s",
             report.built, report.seconds, builder.workers, before,
             f"; {report.failed} failed (MLX builds those): {report.errors[0]}" if report.failed else "")  # fmt: skip


def forward_jobs(model: nn.Module, rows=(16, 32, 64, 128, 256, 512, 2048)) -> list[Job]:
    """MLX's own quantized matmul at the model's shapes and prompt-chunk
    row counts: on CUDA each of its tile sizes is a CUTLASS template MLX
    builds at first use (a fresh H100's first 4-bit prompt waited ~50 s,
    kernels/README.md), built side by side by kernels/prebuild.py instead.
    Shape by shape, row counts inside."""
    return [Job(guards.QMM.name, "stock", (m, k, n, dtype_name(dtype), bits, gs))
            for k, n, dtype, bits, gs in model_shapes(model) for m in rows]  # fmt: skip


def _prove(model: nn.Module, setting: str, widths, guard: Guard | None, fused_guard: Guard | None,
           cache_dir: Path | None, stop: threading.Event | None = None,
           one_row: bool = False, builder: Builder | None = None,
           urgent: bool = False, turn=None) -> Wiring | _Proved | None:  # fmt: skip
    """Every verdict `prepare` reads, proved where not recorded (inside
    guard.recorded_only(): Unproved raised instead); nothing installed.
    A Wiring where no kernel can be used, None when `stop` was set.
    one_row: every shape and sibling group at one row too (hook.one_row).
    builder: what is not recorded is built side by side first (kernels/prebuild.py;
    with its `arch`, our kernels too: kernels/nvrtc.py), `urgent`ly: ahead
    of the builds queued. turn: called before each proof, returns when it
    may run (the engines: once the model's step or round in progress has
    ended)."""
    if setting not in SETTINGS:
        raise ValueError(f"kernels: expected one of {SETTINGS}, got {setting!r}")
    if setting == "off":  # (a hook another engine installed stays; this one's verify says off)
        return Wiring(False, "kernels: off (config)")
    shapes = model_shapes(model)
    if not shapes:
        return Wiring(False, "not quantized (affine 4/8-bit): stock verify")
    if guard is None:
        if cache_dir is None:
            raise ValueError("kernels: prepare needs a guard, or the cache_dir of the shared ones")
        guard, fused_guard = shared_guard(cache_dir), shared_guard(cache_dir, "qmm_fused")
    widths = tuple(m for m in widths if qmm.MIN_M <= m <= qmm.MAX_M)
    if builder is not None and builder.arch and not guards.only_recorded():
        _seed(builder, guard, shapes, fused_guard, widths, one_row, model, stop, urgent)
    if builder is not None and not guards.only_recorded():
        _build_first(builder, guard, shapes, fused_guard, widths, one_row, model, stop, urgent)
    # Stopped (or yielding: the plain engine gives way to a speculative
    # engine's proofs) before a probe, which builds our kernels in this
    # process where the cancelled builds above did not: on a fresh H100 the
    # plain engine's probes, after its builds were cancelled at once, held
    # the proving lock 16 s, and the process's NVRTC, before the speculative
    # engine's proofs could start.
    with guard._lock:
        found = _usable(guard, shapes, stop)
        if found is None:
            return None
        keep, failed = found
        guard.candidates = keep
        guard.dropped.update(failed)  # (a later call, or engine, finds them gone: says why)
        failed = dict(guard.dropped)
    if not keep:
        why = "; ".join(f"{name}: {d}" for name, d in failed.items())
        return Wiring(False, f"no kernel builds on this device ({why}): stock verify",
                      guard, shapes, widths, 0, failed)  # fmt: skip
    groups = group_shapes(model) if fused_guard is not None else []
    fused_keep = []
    if groups:  # (the guard is shared: its candidates stay; a failed build is a verdict)
        with fused_guard._lock:
            found = _usable(fused_guard, groups, stop)
        if found is None:
            return None
        fused_keep, fused_failed = found
        failed.update(fused_failed)
    if not fused_keep:
        fused_guard, groups = None, []
    fused_ok = 0
    for g, cand, shape in _cases(guard, keep, shapes, fused_guard, fused_keep, groups, widths, one_row):
        if stop is not None and stop.is_set():
            return None
        if turn is not None and not g.recorded(cand, *shape):
            turn()
        v = g.verdict(cand, *shape)
        fused_ok += g is fused_guard and v is not None and v.ok
    return _Proved(guard, fused_guard, shapes, widths, keep, failed, groups, fused_ok)


def prove(model: nn.Module, setting: str = "auto", widths=range(2, 4), *,
          guard: Guard | None = None, fused_guard: Guard | None = None,
          cache_dir: Path | None = None, stop: threading.Event | None = None,
          one_row: bool = False, builder: Builder | None = None, urgent: bool = False,
          turn=None) -> bool:  # fmt: skip
    """Every verdict `prepare` will read for this model, proved now, and
    nothing installed: what an engine runs off its load path (no model lock
    is needed: the proofs run on their own random arrays, on this thread's
    MLX stream). False when `stop` was set before the end. `builder`: what
    is not recorded is built side by side first (kernels/prebuild.py;
    `urgent`: ahead of the builds queued); `turn` is called before each
    proof and returns when it may run."""
    return _prove(model, setting, widths, guard, fused_guard, cache_dir, stop, one_row, builder,
                  urgent, turn) is not None  # fmt: skip


def prepare(model: nn.Module, setting: str = "auto", widths=range(2, 4), *,
            guard: Guard | None = None, fused_guard: Guard | None = None,
            cache_dir: Path | None = None, one_row: bool = False) -> Wiring:  # fmt: skip
    """Install the hook on `model` and prove its verify shapes (see the module docstring).

    Without a `guard`, this process's shared guards for `cache_dir` are used
    (both the per-linear and the fused one); with one, sibling groups are
    fused only if a `fused_guard` is given too. Call it holding the model's
    lock (engines/loading.py): it swaps the classes of the model's linears.
    Inside guard.recorded_only() it proves nothing and raises Unproved
    where a verdict is missing, before installing anything."""
    found = _prove(model, setting, widths, guard, fused_guard, cache_dir, one_row=one_row)
    if isinstance(found, Wiring):
        if found.failed and ("wiring", found.reason) not in found.guard._logged:
            found.guard._logged.add(("wiring", found.reason))  # once per guard
            log.info("%s", found.reason)
        return found
    guard, keep, groups, widths = found.guard, found.keep, found.groups, found.widths
    hooked = hook.install(model, guard, found.fused_guard)
    wired = Wiring(True, "", guard, found.shapes, widths, hooked, found.failed)
    ok = wired.in_use()
    total = len(found.shapes) * len(widths)
    wired.reason = (f"{', '.join(c.name for c in keep)} on {hooked} quantized linears: "
                    f"{ok} of {total} (shape, width) pairs at widths {widths[0]}..{widths[-1]} "
                    f"enabled by the guard" if widths else "no verify widths to prove")  # fmt: skip
    if groups:
        wired.reason += (f"; sibling groups fused in one launch: {found.fused_ok} of "
                         f"{len(groups) * len(widths)} (group, width) pairs")  # fmt: skip
    wired.fused_guard, wired.groups = found.fused_guard, groups
    log.info("kernels: %s", wired.reason)
    return wired


def describe(v: Verdict) -> str:
    """One verdict as a table row."""
    m, k, *ns = v.shape
    n = "+".join(map(str, ns))  # a fused group's N is N0+N1[+N2]

    def f(a, spec):
        return f"{a:{spec}}" if a is not None else "-"

    return (f"{v.kernel:>10} M={m:<2d} K={k:<6d} N={n:<6} {v.dtype:>8} {v.bits}b g{v.group_size:<3d} "
            f"{v.status:>7}  err {f(v.max_error, '.1e')} (bound {f(v.bound, '.1e')})  "
            f"kernel {f(v.kernel_us, '.1f')} us / stock {f(v.reference_us, '.1f')} us"
            + (f"  {v.detail}" if v.detail else ""))  # fmt: skip


__all__ = ["SETTINGS", "Wiring", "describe", "dtype_name", "model_shapes", "prepare", "prove",
           "shared_guard"]
