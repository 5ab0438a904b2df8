"""A copying proposer (ngram) drafts fewer tokens than planned, or none, where
the context offers less: the policy's bookkeeping counts those positions as
misses and the round's time under the depth planned, so its plans compare
ngram with the others by what a round at that depth really commits and costs.
Pure parts, fed RoundStats as the engines report them."""

from __future__ import annotations

import pytest

from specgate.engines.base import LiveState, RoundStats
from specgate.policies.acceptance import AcceptanceTracker
from specgate.policies.costs import expected_tokens
from specgate.policies.decide import ModelPolicy, RequestFeatures, decide
from specgate.policies.live_costs import CostView, LiveCosts
from specgate.policies.model_policy import LivePolicy

NGRAM = ModelPolicy("m", {"ngram": "mlx_ngram", "none": "mlx_plain"}, 8, depths={"ngram": 8})
IDLE = LiveState(0, 0, 0)


def copy_round(asked: int, drafted: int, accepted: int, seconds: float = 0.0) -> RoundStats:
    return RoundStats("m", "ngram", drafted, [j < accepted for j in range(drafted)], drafted + 1,
                      seconds, 100, depth=asked)  # fmt: skip


def plain_step(seconds: float) -> RoundStats:
    return RoundStats("m", "none", 0, seconds=seconds, context_tokens=100)


def test_positions_left_empty_are_misses():
    tracker = AcceptanceTracker(min_rounds=1)
    # Planned 4: copied 2 and both stood, then nothing at positions 3-4.
    tracker.update(copy_round(4, 2, 2), "code")
    # Planned 4: nothing to copy at all.
    tracker.update(copy_round(4, 0, 0), "code")
    rates = tracker.rates("m", "code")["ngram"]
    assert rates[0] == pytest.approx(0.5)  # one round of two drafted and kept position 1
    assert rates[1:] == [1.0, 0.0]  # position 3 was reached once, and was empty
    # A round planned at depth 0 (a plain step of the engine) teaches nothing.
    tracker.update(copy_round(0, 0, 0), "code")
    assert tracker.rates("m", "code")["ngram"][0] == pytest.approx(0.5)


def test_expected_tokens_match_what_rounds_commit():
    """Over many rounds, 1 + a1 + a1 a2 + ... from the tracker equals the mean
    tokens a round at that depth committed, rounds that copied little included."""
    tracker = AcceptanceTracker(alpha=0.0001, min_rounds=1)
    rounds = [copy_round(4, 4, 4), copy_round(4, 3, 1), copy_round(4, 0, 0), copy_round(4, 2, 2),
              copy_round(4, 4, 2), copy_round(4, 1, 0)] * 50  # fmt: skip
    for r in rounds:
        tracker.update(r, "code")
    committed = sum(r.accepted + 1 for r in rounds) / len(rounds)
    got = expected_tokens(tracker.rates("m", "code")["ngram"], 4)
    assert got == pytest.approx(committed, rel=0.02)


def test_costs_are_kept_under_the_depth_planned():
    live = LiveCosts(min_samples=1)
    live.observe(copy_round(8, 8, 8, 0.030))  # the first round of a shape is skipped
    for drafted, seconds in ((8, 0.030), (0, 0.010), (3, 0.016), (0, 0.010)):
        live.observe(copy_round(8, drafted, drafted, seconds))
    e = live.get("ngram", 8, 0)
    assert e is not None and e.mean == pytest.approx((0.030 + 0.010 + 0.016 + 0.010) / 4)
    assert live.get("ngram", 3, 0) is None and live.get("ngram", 0, 0) is None


def learned(policy: LivePolicy, rounds: list[RoundStats], content="prose") -> None:
    for r in rounds:
        policy.observe(r, content)


def live_policy() -> LivePolicy:
    return LivePolicy(NGRAM, live_state=lambda: IDLE, timed=frozenset({"ngram", "none"}),
                      explore_every=0)  # fmt: skip


def test_ngram_goes_off_by_itself_where_it_loses_and_on_where_it_wins():
    # Prose: nothing to copy in most rounds, and each round costs a little
    # more than a plain step: ngram loses, and the plan says so.
    prose = live_policy()
    learned(prose, [plain_step(0.010)] * 12)
    learned(prose, [copy_round(8, 0, 0, 0.011)] * 10 + [copy_round(8, 3, 0, 0.016)] * 3)
    plan = decide(prose.policy, RequestFeatures(100, False), IDLE, prose.view(),
                  prose.acceptance.rates("m", "prose"))  # fmt: skip
    assert (plan.method, plan.reason, plan.source) == ("none", "measured_loss", "live")
    # Code being copied: long copies that stand; ngram wins, at a depth the
    # costs and the acceptance favour.
    code = live_policy()
    learned(code, [plain_step(0.010)] * 12, "code")
    learned(code, [copy_round(8, 8, 8, 0.020)] * 12, "code")
    plan = decide(code.policy, RequestFeatures(100, False, content="code"), IDLE, code.view(),
                  code.acceptance.rates("m", "code"))  # fmt: skip
    assert (plan.method, plan.reason) == ("ngram", "spec_on") and 1 <= plan.depth <= 8
    view = CostView(code.costs, None)
    assert 9 / view.round("ngram", 8, 100).seconds > 1 / view.plain(1, 100).seconds
