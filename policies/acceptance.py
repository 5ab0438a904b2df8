"""Live acceptance per draft position, per model, method and content class (EWMA).

Fed every RoundStats the engines report; read by `decide` as the
conditional rates a_j = P(draft j accepted | drafts before it accepted).
Position j's rate only learns from rounds that reached it (every earlier
draft accepted), which is what makes it conditional.

Rates that have not been fed for `refresh_after_s` are withheld: a method
the policy judged a loss is never run again, so without this its estimate
would stay at whatever it was then. Withheld, the method counts as
unmeasured, the policy tries it on the next request that finds the model
idle, and those rounds bring the estimate up to date.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.base import Method, RoundStats
from policies.content import ContentClass


@dataclass
class _Rates:
    values: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    updated: float = 0.0  # clock time of the last round that taught something


class AcceptanceTracker:
    def __init__(self, alpha: float = 0.05, min_rounds: int = 8,
                 refresh_after_s: float | None = 600.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.alpha = alpha  # weight of the newest observation
        self.min_rounds = min_rounds  # before a position's rate is trusted
        self.refresh_after_s = refresh_after_s
        self.clock = clock
        self._rates: dict[tuple[str, Method, ContentClass], _Rates] = {}

    def update(self, stats: RoundStats, content: ContentClass) -> None:
        if stats.drafted == 0:
            return
        r = self._rates.setdefault((stats.model, stats.method, content), _Rates())
        r.updated = self.clock()
        for j, ok in enumerate(stats.accepted_per_position):
            if j == len(r.values):
                r.values.append(float(ok))
                r.counts.append(1)
            else:
                # Until min_rounds, a plain mean; then exponential forgetting.
                weight = max(self.alpha, 1.0 / (r.counts[j] + 1))
                r.values[j] += weight * (float(ok) - r.values[j])
                r.counts[j] += 1
            if not ok:
                break  # later positions were not reached this round

    def rates(self, model: str, content: ContentClass) -> dict[Method, list[float]]:
        """Trusted per-position rates of each method measured on this model
        and this kind of content. A class not measured yet has none, so the
        policy speculates on it when idle and so learns it."""
        out = {}
        oldest = -float("inf") if self.refresh_after_s is None else self.clock() - self.refresh_after_s
        for (m, method, c), r in self._rates.items():
            if r.updated < oldest:
                continue  # stale: let the policy measure it again
            if m == model and c == content and r.counts and r.counts[0] >= self.min_rounds:
                out[method] = [v for v, n in zip(r.values, r.counts, strict=True)
                               if n >= self.min_rounds]  # fmt: skip
        return out
