"""Live acceptance per draft position, per model, method and content class (EWMA).

Fed every RoundStats the engines report; read by `decide` as the
conditional rates a_j = P(draft j accepted | drafts before it accepted),
for rounds planned at depth >= j. A proposer that copies from the context
may draft fewer than planned: the positions it left empty count as misses,
so 1 + a_1 + a_1 a_2 + ... stays the tokens a round at that depth commits.
Position j's rate only learns from rounds that reached it (every earlier
draft accepted), which is what makes it conditional. A method the policy
judged a loss is still run now and then (policies/explore.py), and those
rounds keep its rates up to date.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specgate.engines.base import Method, RoundStats
from specgate.policies.content import ContentClass


@dataclass
class _Rates:
    values: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


class AcceptanceTracker:
    def __init__(self, alpha: float = 0.05, min_rounds: int = 8):
        self.alpha = alpha  # weight of the newest observation
        self.min_rounds = min_rounds  # before a position's rate is trusted
        self._rates: dict[tuple[str, Method, ContentClass], _Rates] = {}

    def update(self, stats: RoundStats, content: ContentClass) -> None:
        if stats.asked == 0:
            return
        r = self._rates.setdefault((stats.model, stats.method, content), _Rates())
        # A position the proposer drafted nothing for (it copies only what
        # matched) ends the round as a rejection would: a miss.
        outcomes = [*stats.accepted_per_position, *[False] * (stats.asked - stats.drafted)]
        for j, ok in enumerate(outcomes):
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
        policy explores it when idle and so learns it."""
        out = {}
        for (m, method, c), r in self._rates.items():
            if m == model and c == content and r.counts and r.counts[0] >= self.min_rounds:
                out[method] = [v for v, n in zip(r.values, r.counts, strict=True)
                               if n >= self.min_rounds]  # fmt: skip
        return out
