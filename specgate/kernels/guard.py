"""Proof at first use: a custom kernel runs only where it was shown correct and faster.

For every (kernel, shape, dtype, bits, group size) a caller meets, the
guard, once per machine:
1. runs the kernel on random inputs of exactly that shape (weights from
   mx.quantize of normal(0, 1) values, x normal(0, 1)). A kernel that cannot
   be built or launched here (Metal code without Metal, CUDA code on a CPU,
   a compile error) or returns the wrong shape or dtype: `failed`.
2. compares it with the exact answer, the stock `mx.quantized_matmul` in
   float32 (same packed weights, scales and biases cast to float32), row by
   row: error = max |kernel - exact| / max |exact| over each output row.
   Bounds (TOLERANCE) per dtype: float32 2e-5, float16 2e-3 (4 ulp at the row's
   largest value), bfloat16 1.6e-2 (4 ulp); any non-finite output is wrong.
   Over the bound: `wrong`. (The stock path at the live dtype is measured the
   same way and recorded as `reference_error`: on a CPU MLX's bf16 path is
   itself off by up to ~1e-1, so it cannot serve as the yardstick.)
3. times the kernel against the stock path at the live dtype: medians of
   `reps` timings, each one eval of a chain of `inner` calls, each call's
   input waiting on the last one's output (on a GPU, over enough copies of
   the weights to overflow the L2 cache, as a forward that streams every
   layer's weights does), alternating the two. Enabled (`ok`) only if
   the kernel's median is below `margin` (0.95) x the stock median; else
   `slower`.
The verdict (status, both times, the error and its bound) is written to
<cache_dir>/<machine key>/qmm.json, keyed by kernel name and the hash of its
source file, and read back by later processes: the check runs once. The
machine key (kernels/machine.py) names the GPU, driver, CUDA, CPU and MLX
version, and the file holds the full description: a file whose recorded key
is another machine's is not read, and its kernels are proved again. The caller
names the cache_dir (the engines: $SPECGATE_HOME/kernels, engines/home.py);
kernels/ reads no environment for it.
A refused kernel costs one log line and the stock path is used; never a
wrong answer.

The guard is generic over the op a family of kernels replaces (`Op`): the
quantized matmul above is `QMM`, the default; another op (bench/verify_attention_kernel.py's
`ATTENTION`) says how to name a shape, make random inputs of it, compute the
exact answer and the stock one, and which inputs to copy to overflow L2. A
Guard serves one op, its verdicts in <cache_dir>/<machine>/<op.name>.json.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from specgate.kernels import qmm, qmm_mma
from specgate.kernels.machine import key as machine_key
from specgate.kernels.machine import this_machine

log = logging.getLogger("specgate.kernels")

TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
STATUSES = ("ok", "wrong", "slower", "failed")
# How kernels are timed; verdicts recorded under another method are proved again.
TIMING = "chain"


class Unproved(LookupError):
    """A verdict not recorded yet, asked for inside `recorded_only()`."""


_local = threading.local()


@contextmanager
def recorded_only() -> Iterator[None]:
    """On this thread, every guard answers from its recorded verdicts only
    and raises Unproved instead of running a proof: what an engine loading
    a model asks first, so that proofs it would wait for run elsewhere."""
    prev, _local.recorded_only = getattr(_local, "recorded_only", False), True
    try:
        yield
    finally:
        _local.recorded_only = prev


def only_recorded() -> bool:
    """Whether this thread is inside `recorded_only()`."""
    return getattr(_local, "recorded_only", False)


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


class Op:
    """What the guard needs to know about the stock op a family of kernels replaces.

    A shape is a tuple whose items are ints and one dtype (for QMM: M, K, N,
    dtype, bits, group size); kernels are called fn(*args) like `stock`."""

    name = "qmm"  # verdicts file <name>.json
    stock_name = "quantized_matmul"  # for the log line
    def heavy_args(self, args: tuple) -> tuple[int, ...]:
        """Which of a call's args are copied to overflow L2 when timing."""
        return (1, 2, 3)  # wq, scales, biases

    def joined(self, y):
        """One array from what a kernel (or stock) returns, to be compared."""
        return y

    def shape_of(self, x, wq, scales, biases, group_size, bits) -> tuple:
        return math.prod(x.shape[:-1]), x.shape[-1], wq.shape[0], x.dtype, bits, group_size

    def dtype(self, m, k, n, dtype, bits, group_size):
        return dtype

    def key(self, name, version, m, k, n, dtype, bits, group_size) -> str:
        return shape_key(name, version, m, k, n, dtype_name(dtype), bits, group_size)

    def fields(self, m, k, n, dtype, bits, group_size) -> dict:
        return {"shape": [m, k, n], "bits": bits, "group_size": group_size}

    def describe(self, m, k, n, dtype, bits, group_size) -> str:
        return f"M={m} K={k} N={n} {dtype_name(dtype)} {bits}-bit g{group_size}"

    def inputs(self, seed, m, k, n, dtype, bits, group_size) -> tuple:
        keys = mx.random.split(mx.random.key(seed + 7919 * m + k + 31 * n), 2)
        w = mx.random.normal((n, k), key=keys[0]).astype(dtype)
        wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        x = mx.random.normal((m, k), key=keys[1]).astype(dtype)
        return x, wq, scales, biases, group_size, bits

    def out_shape(self, m, k, n, dtype, bits, group_size) -> tuple:
        return (m, n)

    def stock(self, *args):
        return qmm.reference_qmm(*args)

    def exact(self, x, wq, scales, biases, group_size, bits):
        f32 = mx.float32
        return qmm.reference_qmm(x.astype(f32), wq, scales.astype(f32), biases.astype(f32),
                                 group_size, bits)  # fmt: skip


QMM = Op()


class FusedQMM(Op):
    """2 or 3 quantized matmuls that share x (a layer's q/k/v or gate/up) in
    one launch. Args: x, wq0, s0, b0, wq1, s1, b1[, wq2, s2, b2], group_size,
    bits; shape (M, K, (N0, N1[, N2]), dtype, bits, group_size); kernels and
    stock return one output per part, compared side by side (concatenated)."""

    name = "qmm_fused"
    stock_name = "quantized_matmul per part"

    def heavy_args(self, args: tuple) -> tuple[int, ...]:
        return tuple(range(1, len(args) - 2))

    def joined(self, y):
        return mx.concatenate(list(y), axis=-1) if isinstance(y, (list, tuple)) else y

    def shape_of(self, x, *args) -> tuple:
        ns = tuple(wq.shape[0] for wq in args[:-2:3])
        return math.prod(x.shape[:-1]), x.shape[-1], ns, x.dtype, args[-1], args[-2]

    def key(self, name, version, m, k, ns, dtype, bits, group_size) -> str:
        return shape_key(name, version, m, k, "+".join(map(str, ns)), dtype_name(dtype), bits,
                         group_size)  # fmt: skip

    def fields(self, m, k, ns, dtype, bits, group_size) -> dict:
        return {"shape": [m, k, *ns], "bits": bits, "group_size": group_size}

    def describe(self, m, k, ns, dtype, bits, group_size) -> str:
        return f"M={m} K={k} N={'+'.join(map(str, ns))} {dtype_name(dtype)} {bits}-bit g{group_size}"

    def inputs(self, seed, m, k, ns, dtype, bits, group_size) -> tuple:
        keys = mx.random.split(mx.random.key(seed + 7919 * m + k + 31 * sum(ns)), len(ns) + 1)
        flat = []
        for n, key in zip(ns, keys[1:], strict=True):
            w = mx.random.normal((n, k), key=key).astype(dtype)
            flat += mx.quantize(w, group_size=group_size, bits=bits)
        x = mx.random.normal((m, k), key=keys[0]).astype(dtype)
        return (x, *flat, group_size, bits)

    def out_shape(self, m, k, ns, dtype, bits, group_size) -> tuple:
        return (m, sum(ns))

    def stock(self, x, *args):
        gs, bits = args[-2:]
        return [qmm.reference_qmm(x, *args[i : i + 3], gs, bits) for i in range(0, len(args) - 2, 3)]

    def exact(self, x, *args):
        f32, gs, bits = mx.float32, args[-2], args[-1]
        return mx.concatenate([qmm.reference_qmm(x.astype(f32), args[i], args[i + 1].astype(f32),
                                                 args[i + 2].astype(f32), gs, bits)
                               for i in range(0, len(args) - 2, 3)], axis=-1)  # fmt: skip


FUSED_QMM = FusedQMM()


@dataclass(frozen=True)
class Candidate:
    """A kernel that wants to replace the stock quantized matmul.

    fn(x, wq, scales, biases, group_size, bits) -> y, like reference_qmm;
    version changes whenever its code does (a changed kernel is re-proved):
    the real kernels' is a hash of their module's source file (qmm.py,
    qmm_mma.py), kernel text and launch configuration alike."""

    name: str
    version: str
    fn: Callable[..., mx.array]
    supports: Callable[..., bool] = qmm.supports
    # (shape) -> the kernel's launch as MLX writes it, for a CUDA kernel
    # compiled ahead into MLX's cache (kernels/nvrtc.py); None: MLX builds it
    launch: Callable[..., object] | None = None


def backend_present(kernel: str) -> bool:
    """Whether the GPU backend a kernel is written for (its name's prefix:
    cuda_, metal_) exists in this process; True for any other kernel."""
    if kernel.startswith("cuda_"):
        return mx.cuda.is_available()
    if kernel.startswith("metal_"):
        return mx.metal.is_available()
    return True


def cuda_candidate() -> Candidate:
    return Candidate("cuda_qmm", qmm.CUDA_VERSION, qmm.cuda_qmm, launch=qmm.cuda_launch)


def cuda_mma_candidate() -> Candidate:
    return Candidate("cuda_qmm_mma", qmm_mma.VERSION, qmm_mma.cuda_qmm_mma, qmm_mma.supports,
                     qmm_mma.cuda_launch)  # fmt: skip


def cuda_mma_fused_candidate() -> Candidate:
    """For a Guard(op=FUSED_QMM)."""
    return Candidate("cuda_qmm_mma_fused", qmm_mma.FUSED_VERSION, qmm_mma.cuda_qmm_mma_fused,
                     qmm_mma.supports_fused, qmm_mma.cuda_launch)  # fmt: skip


def metal_candidate() -> Candidate:
    return Candidate("metal_qmm", qmm.METAL_VERSION, qmm.metal_qmm)


def default_candidates() -> list[Candidate]:
    """Every kernel everywhere: those that cannot build here are recorded as
    failed once, and the check decides about the others."""
    cuda = [cuda_mma_candidate(), cuda_candidate()]
    return [metal_candidate(), *cuda] if mx.metal.is_available() else [*cuda, metal_candidate()]


@dataclass
class Verdict:
    kernel: str
    version: str
    shape: list[int]  # [M, K, N] (QMM; another op's shape, e.g. attention's [M, Hq, Hkv, L, D])
    dtype: str
    bits: int | None  # None where the op has none
    group_size: int | None
    status: str
    max_error: float | None = None
    bound: float | None = None
    reference_error: float | None = None
    kernel_us: float | None = None
    reference_us: float | None = None
    detail: str = ""
    checked_at: float = field(default_factory=time.time)
    # What the proof cost: the whole check, and of it the kernel's first call
    # (where a GPU builds it: a fresh machine's proofs are mostly builds).
    check_s: float | None = None
    first_call_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def shape_key(name: str, version: str, m: int, k: int, n: int | str, dtype: str, bits: int,
              group_size: int) -> str:  # fmt: skip
    return f"{name}@{version}|M{m}|K{k}|N{n}|{dtype}|b{bits}|g{group_size}"


def row_error(y: mx.array, exact: mx.array) -> float:
    """max over rows of max|y - exact| / max|exact| (inf if y is not finite)."""
    y = y.astype(mx.float32).reshape(-1, exact.shape[-1])
    exact = exact.astype(mx.float32).reshape(-1, exact.shape[-1])
    if not mx.all(mx.isfinite(y)).item():
        return math.inf
    num = mx.abs(y - exact).max(axis=-1)
    den = mx.maximum(mx.abs(exact).max(axis=-1), 1e-30)
    return (num / den).max().item()


class Guard:
    """Per-machine verdicts on the kernels that replace one op (default: the
    small-M quantized matmul)."""

    def __init__(self, candidates: list[Candidate] | None = None, *, cache_dir: Path,
                 machine: str | None = None, reps: int = 7, inner: int = 8,
                 margin: float = 0.95, flush_bytes: int | None = None, seed: int = 0,
                 record: bool = True, op: Op = QMM, description: dict | None = None):  # fmt: skip
        """description: the machine the verdicts hold for (default: this
        one, kernels/machine.py), written beside them; machine: the key
        they are kept under (default: the description's; a test may name one)."""
        self.op = op
        if candidates is None and op is not QMM:
            raise ValueError(f"no default candidates for op {op.name}: pass them")
        self.candidates = default_candidates() if candidates is None else list(candidates)
        self.description = this_machine() if description is None else dict(description)
        self.machine = machine or machine_key(self.description)
        # Verdicts are read back from (and, with `record`, written to) here.
        self.path = Path(cache_dir) / self.machine / f"{op.name}.json"
        self.reps, self.inner, self.margin, self.seed = reps, inner, margin, seed
        self.record = record
        gpu = mx.default_device() == mx.gpu
        self.flush_bytes = (128 << 20 if gpu else 0) if flush_bytes is None else flush_bytes
        self._lock = threading.RLock()
        self._verdicts: dict[str, Verdict] | None = None
        self._logged: set[tuple] = set()
        # Candidates kernels/wiring.py dropped for this process (they cannot
        # build here), and why.
        self.dropped: dict[str, str] = {}
        self.checks_run = 0  # proofs run by this process (the rest were read back)

    # ------------------------------------------------------------- storage
    def _load(self) -> dict[str, Verdict]:
        if self._verdicts is None:
            self._verdicts = {}
            try:
                raw = json.loads(self.path.read_text())
                if raw.get("machine") != self.machine:  # copied from elsewhere: never trusted
                    log.info("kernel verdicts %s are another machine's (%s): checking again",
                             self.path, raw.get("machine"))  # fmt: skip
                elif raw.get("timing") == TIMING:
                    self._verdicts = {k: Verdict(**v) for k, v in raw.get("verdicts", {}).items()}
                else:
                    log.info("kernel verdicts %s were timed another way: checking again", self.path)
            except FileNotFoundError:
                pass
            except (ValueError, TypeError) as e:
                log.warning("kernel verdicts %s unreadable (%s): checking again", self.path, e)
        return self._verdicts

    def _save(self, key: str, v: Verdict) -> None:
        if not self.record:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # merge with what other processes wrote meanwhile
            raw = json.loads(self.path.read_text())
            same = raw.get("timing") == TIMING and raw.get("machine") == self.machine
            disk = raw.get("verdicts", {}) if same else {}
        except (FileNotFoundError, ValueError):
            disk = {}
        disk[key] = asdict(v)
        out = {"machine": self.machine, "description": self.description, "mlx": mx.__version__,
               "device": str(mx.default_device()), "tolerance": TOLERANCE, "margin": self.margin, "timing": TIMING, "verdicts": disk}  # fmt: skip
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def verdicts(self) -> dict[str, Verdict]:
        with self._lock:
            return dict(self._load())

    # ------------------------------------------------------------- decisions
    def verdict(self, cand: Candidate, *shape) -> Verdict | None:
        """The recorded verdict for `shape` (QMM: m, k, n, dtype, bits, group_size),
        proving the kernel first if there is none (inside `recorded_only()`:
        raising Unproved instead).
        None: the kernel is not written for this shape (stock path, nothing recorded)."""
        if not cand.supports(*shape):
            return None
        key = self.op.key(cand.name, cand.version, *shape)
        with self._lock:
            known = self._load().get(key)
            if known is not None:
                return known
            if only_recorded():
                raise Unproved(f"{self.op.name}: {key}")
            v = self.check(cand, *shape)
            self._verdicts[key] = v
            self._save(key, v)
        if not v.ok:
            said = (cand.name, v.status, v.detail if v.status == "failed" else "")
            if said not in self._logged:
                self._logged.add(said)
                # A kernel for a backend this process lacks (CUDA on a Mac,
                # either on a CPU) fails as expected: said, not warned.
                expected = v.status == "failed" and not backend_present(cand.name)
                log.log(logging.INFO if expected else logging.WARNING,"kernel %s not used for %s: %s%s; stock %s instead", cand.name,
                            self.op.describe(*shape), v.status,
                            f" ({v.detail})" if v.detail else "", self.op.stock_name)  # fmt: skip
        return v

    def recorded_ok(self, cand: Candidate, *shape) -> bool | None:
        """The recorded verdict's `ok` for `shape`, None where none is recorded."""
        with self._lock:
            v = self._load().get(self.op.key(cand.name, cand.version, *shape))
        return None if v is None else v.ok

    def recorded(self, cand: Candidate, *shape) -> bool:
        """Whether a verdict for `shape` is recorded (read back or proved)."""
        with self._lock:
            return self.op.key(cand.name, cand.version, *shape) in self._load()

    def kernel_for(self, *args):
        """The fastest candidate proved ok for this call's shape, or None
        (args as the stock op takes them; QMM: x, wq, scales, biases, group_size, bits)."""
        shape = self.op.shape_of(*args)
        best, best_us = None, math.inf
        for cand in self.candidates:
            v = self.verdict(cand, *shape)
            if v is not None and v.ok and (v.kernel_us or 0.0) < best_us:
                best, best_us = cand.fn, v.kernel_us or 0.0
        return best

    # ------------------------------------------------------------- the proof
    def check(self, cand: Candidate, *shape) -> Verdict:
        t0 = time.perf_counter()
        v = self._check(cand, *shape)
        v.check_s = time.perf_counter() - t0
        return v

    def _check(self, cand: Candidate, *shape) -> Verdict:
        self.checks_run += 1
        op = self.op
        dtype = op.dtype(*shape)
        dt = dtype_name(dtype)
        v = Verdict(kernel=cand.name, version=cand.version, dtype=dt, status="failed",
                    bound=TOLERANCE.get(dt, 0.0), **op.fields(*shape))  # fmt: skip
        args = op.inputs(self.seed, *shape)
        mx.eval([a for a in args if isinstance(a, mx.array)])
        want = op.out_shape(*shape)
        t0 = time.perf_counter()
        try:
            y = op.joined(cand.fn(*args))
            mx.eval(y)
            v.first_call_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any failure to build or run refuses the kernel
            v.detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            return v
        if tuple(y.shape) != tuple(want) or y.dtype != dtype:
            v.detail = f"returned {y.shape} {y.dtype}, expected {tuple(want)} {dtype}"
            return v
        exact = op.exact(*args)
        stock = op.joined(op.stock(*args))
        v.max_error = row_error(y, exact)
        v.reference_error = row_error(stock, exact)
        if not v.max_error <= v.bound:
            v.status = "wrong"
            return v
        try:
            kt, rt = self._time(cand.fn, args)
        except Exception as e:  # noqa: BLE001
            v.detail = f"timing: {type(e).__name__}: {e}"[:300]
            return v
        v.kernel_us, v.reference_us = kt * 1e6, rt * 1e6
        v.status = "ok" if kt < self.margin * rt else "slower"
        return v

    def _time(self, fn, args: tuple) -> tuple[float, float]:
        heavy = self.op.heavy_args(args)
        nbytes = sum(args[i].nbytes for i in heavy)
        sets = [list(args)]
        for _ in range(1, min(32, -(-self.flush_bytes // nbytes))):
            s = list(args)
            for i in heavy:
                s[i] = args[i] + mx.zeros((), args[i].dtype)  # a copy
            sets.append(s)
        mx.eval([[s[i] for i in heavy] for s in sets])
        calls = max(self.inner, len(sets))
        x0 = args[0]

        def run(f):
            # A chain, as in a forward: each call's input waits on the last
            # call's output (one small add between them, the same for both
            # paths). Independent calls would run concurrently on a GPU (MLX
            # puts the graph's independent kernels side by side), which
            # flatters a kernel that fills few multiprocessors: measured on
            # the H200, stock's M = 8 kernel took ~19 us a product that way
            # but ~55 us inside a forward.
            y = None
            for i in range(calls):
                a = sets[i % len(sets)]
                if y is not None:
                    last = y[0] if isinstance(y, (list, tuple)) else y
                    a = [x0 + last[..., :1].astype(x0.dtype), *a[1:]]
                y = f(*a)
            mx.eval(y)

        ref = self.op.stock
        run(fn), run(ref)  # warm-up (compiles)
        kt, rt = [], []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            run(fn)
            kt.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run(ref)
            rt.append(time.perf_counter() - t0)
        return statistics.median(kt) / calls, statistics.median(rt) / calls
