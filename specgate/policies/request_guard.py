"""One request's bound: speculation may not make it slower than `floor` x plain.

The policy plans with model-wide estimates (acceptance per content class,
round costs per shape), and with the share of exploration that runs plans
those estimates do not favour; one request can still lose badly under them:
its own drafts are rejected where the class's are accepted, an explored
plan is held for rounds that show it losing, a handoff and the drafter's
cold round cost what no estimate counts, a shape the process never ran
builds its graph. So each request also keeps its own books, in what it
really took: the seconds between its planner's calls and the tokens
committed in them (policies/model_policy.py's RequestPlanner measures
them; this module is the arithmetic, no clock, no MLX):

- its speculative intervals (switches back to plain decoding included: the
  cost of having speculated) are judged in windows of `min_rounds`, so one
  unlucky round decides nothing; a window whose tokens would have taken
  plain decoding less than `floor` x its seconds is a loss;
- after a loss the request decodes plainly for `backoff_rounds`, doubled
  at each further loss, and until its seconds beyond plain, over all it
  speculated, fit in what the bound allows for all the tokens it committed
  ((1/floor - 1) x their plain time): a request that lost a window wins
  the time back before it may try again. Its exploration ends with it.
So a request loses at most one window (`min_rounds` rounds) before it is
cut, and stays at `floor` x plain or above beyond that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestGuard:
    floor: float = 0.9  # the slowest a request may run, relative to plain decoding; 0: no bound
    min_rounds: int = 8  # speculative rounds per verdict
    backoff_rounds: int = 32  # plain rounds after a first loss, doubled at each further one
    losses: int = 0
    backoff_left: int = 0
    why: str = ""  # the last loss, for the log: "request losing: 0.72x plain over 8 rounds"
    _window_seconds: float = 0.0
    _window_plain: float = 0.0  # what plain decoding would have taken for the window's tokens
    _window_rounds: int = 0
    _spent: float = 0.0  # seconds of every speculative interval
    _spent_plain: float = 0.0  # plain decoding's seconds for their tokens
    _plain_all: float = 0.0  # plain decoding's seconds for every token counted

    @property
    def excess(self) -> float:
        """Seconds the request's speculation cost beyond plain decoding (< 0: won)."""
        return self._spent - self._spent_plain

    @property
    def allowance(self) -> float:
        """Seconds beyond plain the bound allows for the tokens counted so far."""
        return (1 / self.floor - 1) * self._plain_all if self.floor > 0 else float("inf")

    def record(self, speculative: bool, seconds: float, tokens: int, plain_step: float) -> str | None:
        """One interval between planner calls: `seconds` it took, `tokens`
        it committed, `plain_step` what one plain token costs now. Returns
        the loss's description where it ended a losing window."""
        plain = tokens * plain_step
        self._plain_all += plain
        if not speculative:
            return None
        self._spent += seconds
        self._spent_plain += plain
        self._window_seconds += seconds
        self._window_plain += plain
        self._window_rounds += 1
        if self._window_rounds < self.min_rounds:
            return None
        ratio = self._window_plain / self._window_seconds if self._window_seconds > 0 else 1.0
        rounds = self._window_rounds
        self._window_seconds = self._window_plain = 0.0
        self._window_rounds = 0
        if self.floor <= 0 or ratio >= self.floor:
            return None
        self.losses += 1
        self.backoff_left = self.backoff_rounds << (self.losses - 1)
        self.why = f"request losing: {ratio:.2f}x plain over {rounds} rounds"
        return self.why

    def blocks(self) -> bool:
        """Asked once per planner call: whether this round must decode plainly."""
        if self.backoff_left > 0:
            self.backoff_left -= 1
            return True
        return self.losses > 0 and self.excess > self.allowance
