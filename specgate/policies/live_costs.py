"""What plans cost on this machine now, learned from the rounds being served.

Every round an engine times (engines/base.RoundStats) is one observation:
a plain batch step at batch size B, or a speculative round of one method at
one depth, each at the context it ran at (bucketed by powers of two, since
verify cost grows with context). Estimates are running means with their
spread, robust to the noise of a shared machine: the first round of a shape
is skipped (MLX builds each shape's graph once), a stall counts at most
`STALL_CAP` times the current mean, and the mean forgets with weight
`alpha`, so a machine that got busier is followed within tens of rounds.
A method's estimates start over when its engine's verify path changes
(RoundStats.kernels: the kernels proved in the background took over), and
plain batch steps' when the plain engine's batches take them.

`CostView` answers the policy's two questions in seconds: what one plain
step of B sequences costs at a context, and what one speculative round of a
method at a depth costs there. It answers from live estimates where they
exist, from `specgate tune`'s prior (scaled by how this machine compares
with the prior now) where they do not, and says which it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specgate.engines.base import Method, RoundStats, Source
from specgate.policies.costs import CostModel

STALL_CAP = 4.0  # an observation counts at most this many times the mean
_FIRST_BUCKET = 1024  # contexts below this share bucket 0; then one per doubling


def context_bucket(context: int) -> int:
    return 0 if context < _FIRST_BUCKET else int(math.log2(context / _FIRST_BUCKET)) + 1


@dataclass
class RunningEstimate:
    mean: float = 0.0
    var: float = 0.0
    count: int = 0  # observations in the mean (the warm-up round's are not)
    warm_up: int = 1  # observations still to skip: the shape's first round's

    def add(self, x: float, alpha: float) -> None:
        if self.warm_up > 0:
            self.warm_up -= 1  # the shape's first round builds its graph: not a cost
            return
        if self.count == 0:
            self.mean = x
        else:
            x = min(x, STALL_CAP * self.mean)
            w = max(alpha, 1.0 / (self.count + 1))  # a plain mean until 1/alpha rounds
            d = x - self.mean
            self.mean += w * d
            self.var = (1 - w) * (self.var + w * d * d)
        self.count += 1

    @property
    def spread(self) -> float:
        """Relative standard deviation of one round: the estimate's noise."""
        return math.sqrt(self.var) / self.mean if self.mean > 0 else 0.0


@dataclass(frozen=True)
class Estimate:
    seconds: float
    source: Source  # "live" or "tune"


class LiveCosts:
    """Running round costs of one model, fed by its engines' RoundStats."""

    def __init__(self, alpha: float = 0.1, min_samples: int = 4,
                 fallback: LiveCosts | None = None):  # fmt: skip
        self.alpha = alpha
        self.min_samples = min_samples  # before an estimate is used
        # (method, depth, bucket) -> estimate; plain steps are ("none", B, bucket).
        self._rounds: dict[tuple[Method, int, int], RunningEstimate] = {}
        # Where this one has not measured a shape, the other's estimate (a
        # grammar's rounds start from the unconstrained costs, then learn).
        self.fallback = fallback
        # Per method, whether its estimates were measured through the verify
        # kernels (RoundStats.kernels).
        self._kernels: dict[Method, bool] = {}
        # Rounds inside a decode batch (issue 45): (method, depth, batch,
        # bucket) -> the batch round's seconds (each sequence's round spans
        # the one verify forward of all).
        self._batched: dict[tuple[Method, int, int, int], RunningEstimate] = {}

    def observe(self, stats: RoundStats) -> None:
        if stats.seconds <= 0:
            return  # not timed (llama-server reports sums)
        if stats.method == "none":
            if stats.batch > 1 and self._kernels.setdefault("none", stats.kernels) != stats.kernels:
                # The plain engine's batch steps took the kernels once proved
                # (engines/mlx_plain/kernels.py): the stock steps' costs are gone.
                self._rounds = {k: e for k, e in self._rounds.items() if k[0] != "none" or k[1] == 1}
                self._kernels["none"] = stats.kernels
            key = ("none", stats.batch, context_bucket(stats.context_tokens))
        elif stats.batch > 1:
            # A round inside a batch (issue 45): not what a lone round costs.
            if stats.asked > 0:
                # Every stream of a round reports that one round: its first
                # round is B observations to skip, and B more make one sample.
                key4 = (stats.method, stats.asked, stats.batch, context_bucket(stats.context_tokens))
                e = self._batched.setdefault(key4, RunningEstimate(warm_up=stats.batch))
                e.add(stats.seconds, self.alpha)
            return
        elif stats.asked > 0:
            if self._kernels.setdefault(stats.method, stats.kernels) != stats.kernels:
                # The engine switched to its kernels once proved (engines/mlx_spec/
                # kernel_proofs.py): what its stock verify cost no longer holds.
                self._rounds = {k: e for k, e in self._rounds.items() if k[0] != stats.method}
                self._batched = {k: e for k, e in self._batched.items() if k[0] != stats.method}
                self._kernels[stats.method] = stats.kernels
            # By the depth planned, not drafted: what a plan at that depth
            # costs, rounds where a copying proposer drafted less included.
            key = (stats.method, stats.asked, context_bucket(stats.context_tokens))
        else:
            return  # a speculative engine's depth-0 round: neither plan's cost
        self._rounds.setdefault(key, RunningEstimate()).add(stats.seconds, self.alpha)

    def get(self, method: Method, width: int, bucket: int) -> RunningEstimate | None:
        """The trusted estimate of a plain step of batch `width` ("none") or
        a round at depth `width`, in this context bucket."""
        e = self._rounds.get((method, width, bucket))
        if e is not None and e.count >= self.min_samples:
            return e
        return self.fallback.get(method, width, bucket) if self.fallback else None

    def batched(self, method: Method, depth: int, batch: int, bucket: int) -> RunningEstimate | None:
        """The trusted estimate of a round of `batch` sequences speculating
        at `depth` together (measured only: nothing predicts it yet)."""
        e = self._batched.get((method, depth, batch, bucket))
        return e if e is not None and e.count >= self.min_samples * batch else None

    def batches_measured(self, method: Method, depth: int, bucket: int) -> dict[int, RunningEstimate]:
        """batch -> trusted estimate of every batch size measured for this
        method, depth and context bucket."""
        return {b: e for (m, d, b, k), e in self._batched.items()
                if (m, d, k) == (method, depth, bucket) and e.count >= self.min_samples * b}  # fmt: skip

    def measured(self, method: Method, bucket: int | None = None) -> dict[tuple[int, int], RunningEstimate]:
        """(width, bucket) -> estimate of every trusted one of this method."""
        own = {(w, b): e for (m, w, b), e in self._rounds.items()
               if m == method and e.count >= self.min_samples and bucket in (None, b)}  # fmt: skip
        return (self.fallback.measured(method, bucket) if self.fallback else {}) | own

    def snapshot(self) -> dict[tuple[Method, int, int], RunningEstimate]:
        return {k: e for k, e in self._rounds.items() if e.count >= self.min_samples}


class CostView:
    """Round costs in seconds for the policy: live where measured, else the
    tune prior (scaled to the machine as it is now), else unknown (None)."""

    def __init__(self, live: LiveCosts, prior: CostModel | None):
        self.live = live
        self.prior = prior if prior is not None and prior.c1_seconds else None
        self._scale = self._calibration()

    def _calibration(self) -> float:
        """live / prior over every shape both know (count-weighted): the
        prior was measured once, maybe on a quieter machine."""
        if self.prior is None:
            return 1.0
        num = den = 0.0
        for (method, width, bucket), e in self.live.snapshot().items():
            context = 0 if bucket == 0 else _FIRST_BUCKET << (bucket - 1)
            prior = self._prior(method, width, context)
            if prior:
                num += e.count * e.mean / prior
                den += e.count
        return num / den if den else 1.0

    def _prior(self, method: Method, width: int, context: int) -> float | None:
        p = self.prior
        if p is None:
            return None
        if method == "none":
            return p.c1_seconds * p.batch_step_cost(width, context)
        if width + 1 > p.max_width():
            return None
        return p.c1_seconds * p.round_cost(method, width, context)

    def plain(self, batch: int, context: int) -> Estimate | None:
        """One plain step of `batch` sequences decoded together."""
        bucket = context_bucket(context)
        if (e := self.live.get("none", batch, bucket)) is not None:
            return Estimate(e.mean, "live")
        if (prior := self._prior("none", batch, context)) is not None:
            return Estimate(prior * self._scale, "tune")
        return self._nearest("none", batch, bucket)

    def batched_round(self, method: Method, depth: int, batch: int, context: int) -> Estimate | None:
        """One round of `batch` sequences each drafting `depth` tokens of
        `method`, verified in one forward: live where measured, else the
        tune prior's (its verify curve at batch x (depth + 1) rows), else
        the nearest batch size measured live (`_nearest_batch`), never less
        than a plain step of the same batch (the floor `round` keeps)."""
        if (e := self.live.batched(method, depth, batch, context_bucket(context))) is not None:
            est = Estimate(e.mean, "live")
        elif self.prior is not None and method in self.prior.draft and (
                prior := self.prior.batched_round_cost(method, depth, batch, context)) is not None:  # fmt: skip
            est = Estimate(self.prior.c1_seconds * prior * self._scale, "tune")
        elif (near := self._nearest_batch(method, depth, batch, context)) is not None:
            est = near
        else:
            return None
        floor = self.plain(batch, context)
        return Estimate(max(est.seconds, floor.seconds if floor is not None else 0.0), est.source)

    def _nearest_batch(self, method: Method, depth: int, batch: int, context: int) -> Estimate | None:
        """A batch size not measured, from the nearest one that was. A trial
        (model_policy.py) measures the sizes a burst passes through, rarely
        the one asked next. Down to a smaller batch, its round is scaled as
        plain steps of the two sizes compare. Up to a larger one, by the
        streams at least: a speculative batch's round carries work per
        stream (each decoder's drafts, its host work) that a plain step of
        the same rows does not. On an H100, plain steps through the small-M
        kernels grow little from 2 rows to 8, so scaled as plain steps, its
        rounds of 2 streams (~8 ms) promised 8 streams a round of about as
        much, where forced rounds of 8 took ~16 ms, slower than plain
        batching there. An estimate too high only delays a win; one too low
        loses."""
        measured = self.live.batches_measured(method, depth, context_bucket(context))
        if not measured:
            return None
        near = min(measured, key=lambda b: (abs(b - batch), b))
        here, there = self.plain(batch, context), self.plain(near, context)
        scale = here.seconds / there.seconds if here is not None and there is not None else 1.0
        if batch > near:
            scale = max(scale, batch / near)
        return Estimate(measured[near].mean * scale, "live")

    def round(self, method: Method, depth: int, context: int) -> Estimate | None:
        """One round of `method` drafting `depth` tokens, never less than one
        plain step at the same context: a round runs the target over at least
        the row a plain step runs, and more. Without the floor, a round timed
        while the machine was quiet beats a plain step timed since it got
        busy, and a head that is never accepted wins on noise alone."""
        est = self._round(method, depth, context)
        floor = self.plain(1, context)
        if est is not None and floor is not None and est.seconds < floor.seconds:
            return Estimate(floor.seconds, est.source)
        return est

    def _round(self, method: Method, depth: int, context: int) -> Estimate | None:
        bucket = context_bucket(context)
        if (e := self.live.get(method, depth, bucket)) is not None:
            return Estimate(e.mean, "live")
        measured = self.live.measured(method, bucket)
        if measured:
            # Other depths of this method measured here: a round's cost is
            # close to linear in its depth (one verify row and one draft per
            # token), anchored at depth 0, which is a plain step.
            if self.prior is not None:
                near = min((w for w, _ in measured), key=lambda w: abs(w - depth))
                prior_near = self._prior(method, near, context)
                prior_here = self._prior(method, depth, context)
                if prior_near and prior_here:
                    return Estimate(measured[(near, bucket)].mean * prior_here / prior_near, "live")
            return self._linear(depth, bucket, measured)
        if (prior := self._prior(method, depth, context)) is not None:
            return Estimate(prior * self._scale, "tune")
        return self._nearest(method, depth, bucket)

    def _linear(self, depth: int, bucket: int,
                measured: dict[tuple[int, int], RunningEstimate]) -> Estimate | None:  # fmt: skip
        points = {w: e.mean for (w, _), e in measured.items()}
        if (plain := self.live.get("none", 1, bucket)) is not None:
            points.setdefault(0, plain.mean)
        if len(points) < 2:
            return None
        xs = sorted(points)
        lo = max([x for x in xs if x <= depth], default=xs[0])
        hi = min([x for x in xs if x >= depth], default=xs[-1])
        if lo == hi:  # beyond the measured depths: the last two points' slope
            lo, hi = (xs[-2], xs[-1]) if depth > xs[-1] else (xs[0], xs[1])
        slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
        return Estimate(max(points[lo] + slope * (depth - lo), min(points.values())), "live")

    def _nearest(self, method: Method, width: int, bucket: int) -> Estimate | None:
        """The same shape at the nearest context bucket measured: costs grow
        with context, but both plans' alike, so their ratio carries over."""
        found = [b for (w, b) in self.live.measured(method) if w == width]
        if not found:
            return None
        b = min(found, key=lambda b: abs(b - bucket))
        return Estimate(self.live.get(method, width, b).mean, "live")


def prior_view(costs: CostModel) -> CostView:
    """A CostView of a prior alone, in units of c(1) when it has no seconds."""
    if not costs.c1_seconds:
        costs = replace(costs, c1_seconds=1.0)
    return CostView(LiveCosts(), costs)

