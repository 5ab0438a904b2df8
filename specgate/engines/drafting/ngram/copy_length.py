"""How much of a copied draft to verify: as much as pays for its verify rows.

A copy from the context (engines/drafting/ngram/index.py) offers up to the depth the
plan allows, and its match length says how strong it is, but not how strong
on this model and this kind of text, nor what each extra verify row costs
on this machine. On a GPU a row is nearly free and the whole copy should go;
on a CPU running a hybrid model each row costs a third of a plain step, and
a five-token copy of which one token stands is slower than no draft at all.

`CopyEvidence` learns both, per engine, from the rounds it serves:
- acceptance per draft position, conditional on reaching it, for each
  bucket of match length (a 2-token match in prose and a 40-token match in
  a quoted file are different evidence);
- what a round verifying w rows costs (w = 1 is a round without drafts),
  as the proposer sees it: from handing over its drafts to the verdict;
  the median of its last COST_WINDOW rounds, the first one skipped. A
  mean would not do: on MLX's CUDA build every width pays a graph build
  whenever the KV buffer grows (engines/forwards/kv_buffer.py), and a width that
  a few builds made look dear is then cut, so it is seldom timed again,
  and the copies stay cut where they cost nothing (measured on an H200:
  ngram fell from 3.0x to 1.7x plain on copy-heavy transcripts).
`best_length` then keeps the prefix with the most expected tokens per
second (OptiQ's `--ngram-draft`: the length from recent acceptance and the
measured cost of a verify; SuffixDecoding's adaptive length).

Positions not yet measured count as accepted (so the whole copy is tried
until evidence says otherwise), and every EXPLORE_EVERY-th draft of a bucket
goes out whole, so a position cut off once is measured again. Cutting a
draft never changes what is decoded, only how fast: exactness is the
decoder's (engines/mlx_spec/decoder.py), for any drafts.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Lower ends of the match-length buckets.
MATCH_BUCKETS = (2, 3, 4, 6, 9, 16, 32)
EXPLORE_EVERY = 8  # every n-th draft of a bucket is verified whole
MIN_ROUNDS = 4  # observations before a rate or a cost is used
COST_WINDOW = 16  # the rounds of a width whose median is its cost


def match_bucket(match: int) -> int:
    return max(0, bisect.bisect_right(MATCH_BUCKETS, match) - 1)


def best_length(rates: Sequence[float], costs: Sequence[float]) -> int:
    """The number of drafts L (0..len(rates)) that maximises expected tokens
    per second: (1 + a_1 + a_1 a_2 + ... up to L) / cost of verifying L + 1
    rows. `rates[j]` is P(draft j+1 accepted | drafts before it accepted);
    `costs[w - 1]` what a round verifying w rows costs, w = 1..len(rates)+1.
    The longest of equals wins (ties cost nothing and the copy goes on)."""
    best, best_speed = 0, 1.0 / costs[0]
    expected = reach = 1.0
    for length in range(1, len(rates) + 1):
        reach *= rates[length - 1]
        expected += reach
        speed = expected / costs[length]
        if speed >= best_speed:
            best, best_speed = length, speed
    return best


@dataclass
class _Mean:
    """A running mean that forgets with weight `alpha` once it has 1/alpha samples."""

    mean: float = 0.0
    count: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.count += 1
        self.mean += max(alpha, 1.0 / self.count) * (x - self.mean)


@dataclass
class _Cost:
    """A width's recent rounds; the first builds the shape's graph and is skipped."""

    warmed: bool = False
    recent: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))

    def add(self, seconds: float) -> None:
        if self.warmed:
            self.recent.append(seconds)
        self.warmed = True

    @property
    def known(self) -> bool:
        return len(self.recent) >= MIN_ROUNDS

    @property
    def seconds(self) -> float:
        return statistics.median(self.recent)


@dataclass
class CopyEvidence:
    """One engine's evidence (its worker thread runs one sequence at a time)."""

    alpha: float = 0.1
    _rates: dict[int, list[_Mean]] = field(default_factory=dict)  # bucket -> per position
    _costs: dict[int, _Cost] = field(default_factory=dict)  # verify width -> its rounds
    _drafts: dict[int, int] = field(default_factory=dict)  # bucket -> drafts offered

    def length(self, match: int, offered: int) -> int:
        """How many of an `offered`-token copy with this match to verify."""
        b = match_bucket(match)
        self._drafts[b] = n = self._drafts.get(b, 0) + 1
        costs = self.costs(offered + 1)
        if costs is None or n % EXPLORE_EVERY == 0:
            return offered
        rates = [r.mean if r.count >= MIN_ROUNDS else 1.0 for r in self._rates.get(b, [])]
        rates = (rates + [1.0] * offered)[:offered]
        return best_length(rates, costs)

    def costs(self, widths: int) -> list[float] | None:
        """Seconds of a round verifying 1..`widths` rows: measured, else on
        the line through the nearest measured widths (None: fewer than two
        widths measured, nothing to weigh)."""
        known = sorted((w, c.seconds) for w, c in self._costs.items() if c.known)
        if len(known) < 2:
            return None
        xs = [w for w, _ in known]
        out = []
        for w in range(1, widths + 1):
            i = min(max(bisect.bisect_left(xs, w), 1), len(known) - 1)
            (w0, c0), (w1, c1) = known[i - 1], known[i]
            if w == w1:
                out.append(c1)
            else:
                slope = max(0.0, (c1 - c0) / (w1 - w0))
                out.append(max(c0 + slope * (w - w0), known[0][1]))
        return out

    def observe(self, match: int | None, drafted: int, accepted: int, seconds: float) -> None:
        """One round: its copy's match (None: it drafted nothing), how many
        drafts went to verify and how many stood, and what it cost."""
        self._costs.setdefault(drafted + 1, _Cost()).add(seconds)
        if match is None or drafted == 0:
            return
        rates = self._rates.setdefault(match_bucket(match), [])
        for j in range(min(accepted + 1, drafted)):  # positions this round reached
            if j == len(rates):
                rates.append(_Mean())
            rates[j].add(float(j < accepted), self.alpha)


@dataclass
class RoundTimer:
    """What a proposer sees of its round's cost: from its drafts handed over
    (or its answer that it has none) to the verdict."""

    started: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> float | None:
        started, self.started = self.started, None
        return None if started is None else time.perf_counter() - started
