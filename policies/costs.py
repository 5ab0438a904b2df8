"""The cost model: what a plan is expected to deliver, in tokens per second.

Everything is relative to one plain decoding step of one sequence at short
context, c(1) = 1, so measurements from `specgate tune` on the user's machine
plug in directly and nothing here is a constant copied from another machine.

- verify[ctx][M]: c(M, ctx) / c(1), a trunk forward over M new tokens after
  `ctx` tokens of context, measured at a few context lengths; between them
  it is interpolated linearly, beyond them it is held at the last one.
- draft[method]: the drafter's cost per round relative to c(1) (an MTP head
  step per draft, one DFlash block pass, ...): per_round + per_token * k.
- batched[B]: aggregate tokens/s of B sequences decoded together relative to
  one sequence alone (batched[1] = 1).
- acceptance[method][i]: P(draft i+1 accepted | drafts 1..i accepted), the
  live per-position rates (EWMA, see acceptance.py).

A speculative round at depth k commits E = 1 + a1 + a1 a2 + ... tokens and
costs c(k+1, ctx) + draft(k), so it runs at E / (c(k+1, ctx) + draft(k))
times plain decoding.
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

    @classmethod
    def from_measurements(cls, data: Mapping) -> CostModel:
        """From kernels/tune.py's saved form (JSON: keys are strings)."""
        return cls(
            verify={int(c): {int(m): float(v) for m, v in row.items()}
                    for c, row in data["verify"].items()},
            draft={k: DraftCost(float(d.get("per_round", 0.0)), float(d.get("per_token", 0.0)))
                   for k, d in data.get("draft", {}).items()},
            batched={int(b): float(g) for b, g in data.get("batched", {"1": 1.0}).items()},
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


def speculative_speed(costs: CostModel, method: str, acceptance: Sequence[float], depth: int,
                      context: int) -> float:
    """One sequence's tokens/s at this depth, relative to plain decoding."""
    cost = costs.verify_cost(depth + 1, context) + costs.draft.get(method, DraftCost())(depth)
    return expected_tokens(acceptance, depth) / cost
