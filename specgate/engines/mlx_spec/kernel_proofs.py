"""A speculative engine's verify kernels, proved without holding up its load.

At load (`KernelSwitch.start`), the engine asks the guards for the verdicts
its verify widths need, reading only what is recorded for this machine
(kernels/guard.recorded_only): all there, the kernels are wired at once, as
before. Otherwise the engine serves at once on the stock verify path, and a
background thread (one at a time per model: LoadedModel.proving; until
its lone widths are proved it counts in LoadedModel.urgent_proofs, and the
plain engine's batch proofs give the lock way to it between two verdicts):
1. proves what is missing (kernels/wiring.prove). No model lock: a proof
   makes its own random arrays on this thread's MLX stream, and MLX
   evaluates independent arrays from several threads (engines of two models
   already run side by side); requests are served meanwhile, so a proof
   times its kernel and the stock op under the same load;
2. wires the hook from the verdicts now recorded (under the model lock: it
   swaps the linears' classes), and JIT-warms one verify forward per width
   through the kernels, each under the model lock, between rounds;
3. switches the target to the kernels under the model lock (so between two
   rounds), logs one line and lowers `proving`;
4. then proves the widths only a batch of streams verifies (`batch_shapes`,
   engine.py's batched rounds: streams x rows each, up to the hook's 16
   rows) and warms one batched verify forward per shape. Until they are
   proved, `rows` says how many rows the kernels are proved for, and a
   batched round wider than that verifies stock
   (mlx_spec/batch_decoder.py): a round never proves a shape inside it,
   which on a GPU stalls every stream in it for seconds.
Where every verdict is recorded, the kernels are wired at load and the
same thread only warms (each lone width, each batch shape): a new
process builds a shape's kernels at its first use, seconds on a GPU,
which a user's first burst would otherwise wait for.
While `proving`, the policy plans plain decoding for the engine's method
(engines/registry.proving, policies/decide.py: reason `kernels_proving`):
on a GPU, speculation on the stock verify path loses. Where no kernel
builds (a CPU, CUDA code on a Mac) the proofs fail fast and nothing switches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from specgate.engines import kernel_wiring  # the guards' verdicts in SPECGATE_HOME
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.batch_decoder import batched_caches, unbatchable
from specgate.engines.targets import Target
from specgate.kernels import hook, qmm
from specgate.kernels.guard import Unproved, recorded_only
from specgate.kernels.wiring import Wiring

log = logging.getLogger(__name__)


class KernelSwitch(kernel_wiring.ProofThread):
    """One engine's verify path: stock, proving (stock meanwhile) or kernels."""

    def __init__(self, label: str, loaded: LoadedModel, target: Target, setting: str,
                 widths: range, guard=None, drafter=None,
                 batch_shapes: Sequence[tuple[int, int]] = ()):  # fmt: skip
        super().__init__(label)  # its `done`: decided, `wiring` set (or the proofs failed or stopped)
        self.loaded, self.target, self.setting = loaded, target, setting
        # Drafting.kernel_module (the MTP head): wired and proved with the
        # trunk, its multi-row forwards then run inside verify_kernels too.
        self.drafter = drafter
        self.widths, self.guard = widths, guard  # guard None: SPECGATE_HOME's shared ones
        # (streams, rows each) of the batched verify forwards the engine runs,
        # and the widths (rows in all) only those verify, up to the hook's
        self.batch_shapes = list(batch_shapes)
        self.batch_widths = sorted({b * n for b, n in self.batch_shapes if b * n <= qmm.MAX_M}
                                   - set(widths))  # fmt: skip
        self.wiring: Wiring | None = None  # set once decided
        self.proving = False
        # Verify rows the kernels are proved for up to: the lone widths' once
        # switched, the batch widths' too once those are.
        self.rows = 0
        # `rows` is final (batch widths proved, or never will be) and the batch
        # shapes are warmed
        self.batch_done = threading.Event()
        self._urgent = False  # counted in LoadedModel.urgent_proofs until the lone widths are proved

    def _prepare(self) -> Wiring:
        """The trunk's wiring (what decides kernels on or off), the drafter's
        beside it where the trunk's kernels are on."""
        wired = kernel_wiring.prepare(self.loaded.model, self.setting, self.widths, guard=self.guard)
        if wired.enabled and self.drafter is not None:
            kernel_wiring.prepare(self.drafter, self.setting, self.widths, guard=self.guard)
        return wired

    def start(self) -> None:
        """Wire the kernels now where every verdict is recorded; else prove
        them in a background thread."""
        try:
            with self.loaded.lock, recorded_only():
                wired = self._prepare()
        except Unproved:
            self.proving = True
            # Pending from now until its lone widths are proved: the plain
            # engine's proofs yield the model's proving lock to these.
            self._urgent = True
            self.loaded.urgent_proofs.begin()
            self._background(self._run)
            log.info("%s: verify stock while its kernels are proved in the background", self.label)
            return
        self._use(wired)
        log.info("%s: verify %s", self.label,
                 "through kernels/hook.py" if self.target.kernels else "stock")  # fmt: skip
        if not wired.enabled:
            self.batch_done.set()
        elif self._recorded(self.batch_widths):
            self.rows = max([*self.batch_widths, self.rows])
            self._background(self._warm_recorded)
        else:
            self._background(self._run_batch)

    def _use(self, wired: Wiring) -> None:
        self.wiring = wired
        self.target.kernels = wired.enabled
        self.rows = wired.widths[-1] if wired.enabled and wired.widths else 0
        self.proving = False
        self.done.set()

    def _modules(self):
        return [m for m in (self.loaded.model, self.drafter) if m is not None]

    def _recorded(self, widths: Sequence[int]) -> bool:
        """Whether every verdict for `widths` is recorded for this machine."""
        try:
            with recorded_only():
                for module in self._modules():
                    kernel_wiring.prove(module, self.setting, widths, guard=self.guard)
        except Unproved:
            return False
        return True

    def _prove(self, widths: Sequence[int], urgent: bool = False) -> bool:
        """Proves `widths` for the trunk and the drafter (False: stopped);
        `urgent`: their builds ahead of what is queued (kernels/prebuild.py)."""
        return all(kernel_wiring.prove(module, self.setting, widths, guard=self.guard,
                                       stop=self._stop, urgent=urgent, loaded=self.loaded)  # fmt: skip
                   for module in self._modules())

    def _run(self) -> None:
        self._run_lone()
        if self.target.kernels and self.batch_widths and not self._stop.is_set():
            self._run_batch()
        else:
            self.batch_done.set()

    def _run_lone(self) -> None:
        """Steps 1-3."""
        try:
            with self.loaded.proving:
                if not self._prove(self.widths, urgent=True):
                    return
                with self.loaded.lock:
                    try:
                        with recorded_only():
                            wired = self._prepare()
                    except Unproved:  # a verdict dropped meanwhile: proved here, rarely
                        wired = self._prepare()
            if wired.enabled:
                for width in wired.widths:
                    if self._stop.is_set():
                        return
                    with self.loaded.lock:
                        self._warm(width)
            with self.loaded.lock:  # between two rounds: a round runs holding it
                self._use(wired)
            log.info("%s: kernels proved in the background; verify %s from now on (%s)",
                     self.label, "through kernels/hook.py" if wired.enabled else "stock",
                     wired.reason)  # fmt: skip
        except Exception:
            log.exception("%s: proving its kernels failed; verify stays stock", self.label)
        finally:
            self.proving = False
            self.done.set()
            if self._urgent:
                self._urgent = False
                self.loaded.urgent_proofs.end()

    def _run_batch(self) -> None:
        """Step 4: the batch widths, after the switch (the lone stream's
        speculation does not wait for them)."""
        try:
            with self.loaded.proving:
                if not self._prove(self.batch_widths):
                    return
            self.rows = max([*self.batch_widths, self.rows])
            self._warm_batches()
            log.info("%s: kernels proved for batches too (verify rows up to %d)", self.label,
                     self.rows)  # fmt: skip
        except Exception:
            log.exception("%s: proving its kernels for batches failed; batches wider than %d "
                          "rows verify stock", self.label, self.rows)  # fmt: skip
        finally:
            self.batch_done.set()

    def _warm_recorded(self) -> None:
        """Verdicts recorded at load: each width's and batch shape's kernels
        built now, in the background, rather than in the first rounds."""
        try:
            for width in self.widths:
                if self._stop.is_set():
                    return
                with self.loaded.lock:
                    self._warm(width)
            self._warm_batches()
        except Exception:
            log.exception("%s: warming its verify kernels failed (they build at first use)",
                          self.label)  # fmt: skip
        finally:
            self.batch_done.set()

    def _warm_batches(self) -> None:
        """One batched verify forward per (streams, rows each) shape, each
        stream a one-token sequence, through the kernels where the rows are
        proved (a wider one runs stock, as its round would)."""
        if not self.batch_shapes or unbatchable(self.target) is not None:
            return  # the engine does not batch this model (mlx_spec/engine.py)
        recurrent = any(type(c) is ArraysCache for c in self.target.make_cache())  # as its rounds, by tape
        for streams in sorted({b for b, _ in self.batch_shapes}):
            with self.loaded.lock:
                caches = [self.target.make_cache() for _ in range(streams)]
                for cache in caches:
                    mx.eval(self.target.forward(mx.zeros((1, 1), dtype=mx.int32), cache).hidden)
            for b, n in self.batch_shapes:
                if b != streams:
                    continue
                if self._stop.is_set():
                    return
                with self.loaded.lock:
                    batch = batched_caches(caches)
                    tokens = mx.zeros((b, n), dtype=mx.int32)
                    with hook.kernels(b * n <= self.rows):
                        forward = self.target.forward(tokens, batch, undo="tape" if recurrent else None)
                        mx.eval(self.target.logits(forward.hidden))

    def _warm(self, width: int) -> None:
        """One verify forward (and its logits) of `width` rows through the
        kernels, on a throwaway cache: MLX builds that graph's kernels now,
        not in the first round that uses them."""
        cache = self.target.make_cache()
        tokens = mx.arange(width, dtype=mx.int32)[None] % self.target.vocab_size
        with hook.kernels():
            forward = self.target.forward(tokens, cache)
            mx.eval(self.target.logits(forward.hidden))
