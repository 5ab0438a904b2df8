"""The cost model of `specgate tune`'s measurements, the policy's prior.

policies/live_costs.py turns it into seconds (c1_seconds) wherever live
estimates are missing.

Everything is relative to c(1), a bare trunk forward over one token at short
context, so measurements from `specgate tune` on the user's machine plug in
directly and nothing here is a constant copied from another machine.

- verify[ctx][M]: c(M, ctx) / c(1), a trunk forward over M new tokens after
  `ctx` tokens of context, measured at a few context lengths; between them
  it is interpolated linearly, beyond them it is held at the last one.
- plain_step: what a plain decoding step really costs at short context
  (the forward plus sampling and the batch's bookkeeping), >= 1.
- draft[method]: what a speculative round costs beyond its verify forward:
  the drafter and the round's own fixed work (acceptance, rollback),
  per_round + per_token * k, fitted to timed rounds of the real decoder.
- batched[B]: aggregate tokens/s of B sequences decoded together relative to
  one sequence alone (batched[1] = 1).
- acceptance[method][i]: P(draft i+1 accepted | drafts 1..i accepted), the
  live per-position rates (EWMA, see acceptance.py).

A speculative round at depth k commits E = 1 + a1 + a1 a2 + ... tokens and
costs c(k+1, ctx) + draft(k); a plain step at that context costs
plain_step + c(1, ctx) - c(1). Speculation runs at E times the ratio of the
two relative to plain decoding. Without a fixed cost (plain_step 1, draft
overheads 0) this is the textbook E / (c(k+1) + draft(k)); on a small model
the fixed costs are most of a step, and leaving them out predicted 1.18x
for a depth that measured 0.87x.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DraftCost:
    per_round: float = 0.0
    per_token: float = 0.0

    def __call__(self, depth: int) -> float:
        return self.per_round + self.per_token * depth if depth else 0.0


@dataclass(frozen=True)
class CostModel:
    verify: Mapping[int, Mapping[int, float]]  # context -> {M: c(M, ctx)/c(1)}
    draft: Mapping[str, DraftCost] = field(default_factory=dict)
    batched: Mapping[int, float] = field(default_factory=lambda: {1: 1.0})
    plain_step: float = 1.0
    c1_seconds: float | None = None  # what c(1) took when measured: turns the prior into seconds

    @classmethod
    def from_measurements(cls, data: Mapping) -> CostModel:
        """From kernels/tune.py's saved form (JSON: keys are strings)."""
        return cls(
            verify={int(c): {int(m): float(v) for m, v in row.items()}
                    for c, row in data["verify"].items()},
            draft={k: DraftCost(float(d.get("per_round", 0.0)), float(d.get("per_token", 0.0)))
                   for k, d in data.get("draft", {}).items()},
            batched={int(b): float(g) for b, g in data.get("batched", {"1": 1.0}).items()},
            plain_step=float(data.get("plain_step", 1.0)),
            c1_seconds=float(data["c1_seconds"]) if data.get("c1_seconds") else None,
        )  # fmt: skip

    def verify_cost(self, width: int, context: int) -> float:
        contexts = sorted(self.verify)
        if context <= contexts[0]:
            return _at(self.verify[contexts[0]], width)
        if context >= contexts[-1]:
            return _at(self.verify[contexts[-1]], width)
        i = bisect.bisect_right(contexts, context)
        lo, hi = contexts[i - 1], contexts[i]
        t = (context - lo) / (hi - lo)
        return (1 - t) * _at(self.verify[lo], width) + t * _at(self.verify[hi], width)

    def max_width(self) -> int:
        return min(max(curve) for curve in self.verify.values())

    def batched_gain(self, sequences: int) -> float:
        return _at(self.batched, max(1, sequences))

    def plain_cost(self, context: int) -> float:
        """One plain decoding step of one sequence after `context` tokens."""
        return self.plain_step + self.verify_cost(1, context) - self.verify_cost(1, 0)

    def batch_step_cost(self, batch: int, context: int) -> float:
        """One plain step of `batch` sequences decoded together."""
        return batch * self.plain_cost(context) / self.batched_gain(batch)

    def round_cost(self, method: str, depth: int, context: int) -> float:
        """One speculative round at this depth: its verify and its drafting."""
        return self.verify_cost(depth + 1, context) + self.draft.get(method, DraftCost())(depth)

    def batched_round_cost(self, method: str, depth: int, batch: int, context: int) -> float | None:
        """One round of `batch` sequences each drafting `depth` tokens, all
        verified in one forward (a speculative engine's batch, issue 45):
        that forward of batch x (depth + 1) rows, and each sequence's own
        drafting and fixed work; None past the widths measured (the curve
        is flat only as far as it was timed)."""
        rows = batch * (depth + 1)
        if rows > self.max_width():
            return None
        return self.verify_cost(rows, context) + batch * self.draft.get(method, DraftCost())(depth)


def _at(curve: Mapping[int, float], x: int) -> float:
    """curve at x, linear between measured points, held beyond the last."""
    if x in curve:
        return curve[x]
    xs = sorted(curve)
    if x <= xs[0]:
        return curve[xs[0]]
    if x >= xs[-1]:
        return curve[xs[-1]]
    i = bisect.bisect_right(xs, x)
    lo, hi = xs[i - 1], xs[i]
    return curve[lo] + (curve[hi] - curve[lo]) * (x - lo) / (hi - lo)


def expected_tokens(acceptance: Sequence[float], depth: int) -> float:
    """E[tokens committed per round] at this depth: 1 + a1 + a1 a2 + ..."""
    total, reach = 1.0, 1.0
    for j in range(depth):
        reach *= acceptance[j] if j < len(acceptance) else (acceptance[-1] if acceptance else 0.0)
        total += reach
    return total
