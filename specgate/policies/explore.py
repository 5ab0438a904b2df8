"""Which idle requests try a plan the estimates do not favour.

The policy only learns the cost of plans it runs: once plain decoding wins,
speculation's estimates would never change again, and a method that starts
winning (the content changed, the machine got quieter) would never be found.
So a small, capped share of idle requests explores:

- an arm (plain decoding, or a speculative method) with no estimate yet is
  tried at once, at most `unmeasured_tries` times (a request too short to
  time a few rounds teaches nothing, and must not make every request explore);
- otherwise an arm not run for `every` idle decisions is tried, at most one
  exploration per `every` decisions, and each time it is still not the best
  its interval doubles, up to `max_every`: a method that keeps losing costs
  less and less.
An exploring request holds the explored plan for `hold_rounds` rounds (enough
to time it), then follows the policy again, so exploring costs a few rounds,
not a whole request.

Pure bookkeeping: counts decisions, no clock, no MLX.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specgate.engines.base import Method


@dataclass
class Explorer:
    every: int = 16
    max_every: int = 256
    unmeasured_tries: int = 3
    hold_rounds: int = 16
    decisions: int = 0
    _last_run: dict[Method, int] = field(default_factory=dict)  # decision it last ran at
    _interval: dict[Method, int] = field(default_factory=dict)
    _tries: dict[Method, int] = field(default_factory=dict)  # unmeasured explorations
    _last_exploration: int = -(1 << 30)

    def choose(self, exploit: Method, measured: Mapping[Method, bool]) -> Method | None:
        """One idle decision whose plan runs `exploit`: the arm to try
        instead, or None. `measured` says for every arm whether the policy has
        estimates for it."""
        self.decisions += 1
        n = self.decisions
        self._last_run[exploit] = n
        self._interval[exploit] = self.every  # the best arm: a loser again starts short
        if self.every <= 0:
            return None
        others = [a for a in measured if a != exploit]
        for arm in others:
            if not measured[arm] and self._tries.get(arm, 0) < self.unmeasured_tries:
                self._tries[arm] = self._tries.get(arm, 0) + 1
                return self._explored(arm)
        if n - self._last_exploration < self.every:
            return None
        due = [a for a in others if n - self._last_run.get(a, 0) >= self._interval.get(a, self.every)]
        if not due:
            return None
        arm = min(due, key=lambda a: self._last_run.get(a, 0))  # the stalest first
        self._interval[arm] = min(2 * self._interval.get(arm, self.every), self.max_every)
        return self._explored(arm)

    def _explored(self, arm: Method) -> Method:
        self._last_run[arm] = self._last_exploration = self.decisions
        return arm
