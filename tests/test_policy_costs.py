"""The cost-model decision, on curves taken from published measurements.

Sources (../shared/reference/speculative-decoding-on-apple-silicon.txt):
- OptiQ, Qwen3.6-27B 4-bit, stock mlx-lm kernels, greedy MTP at ~72%
  acceptance: K=1 1.36x, K=2 1.34x, K=3 0.94x, K=4 0.74x. With per-position
  acceptance 0.72, 0.60, 0.50, 0.45 (falling with depth, as every published
  per-position curve does) that pins the full-model verify curve at
  c(2)=1.26, c(3)=1.61, c(4)=2.52, c(5)=3.33 (c(k+1) = E[tokens]/speedup).
- A custom small-M kernel (the issue-9 goal: c(M)/c(1) <= 1.3 up to M = 8).
- mlx-dspark batching, Qwen3-4B: 2.48x aggregate at B=4, 4.00x at B=8 (hybrid).
- Long context: mlx-dspark fixed-cap-7 configs fell to 0.53-0.97x at 32k;
  here verify at 32k costs 1.9x its short-context cost per extra row.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.engines.base import LiveState
from specgate.policies.costs import CostModel, DraftCost, expected_tokens
from specgate.policies.decide import (
    SWITCH_MARGIN,
    SWITCH_TOKENS,
    ModelPolicy,
    RequestFeatures,
    candidates,
    decide,
)

ACCEPT = [0.72, 0.60, 0.50, 0.45, 0.40, 0.35, 0.30]
STOCK_4BIT = CostModel({0: {1: 1.0, 2: 1.26, 3: 1.61, 4: 2.52, 5: 3.33}},
                       batched={1: 1.0, 4: 2.48, 8: 4.0})  # fmt: skip
FLAT = CostModel({0: {m: 1.0 + 0.03 * (m - 1) for m in range(1, 9)}},
                 draft={"mtp": DraftCost(per_token=0.02)}, batched={1: 1.0, 4: 2.48})  # fmt: skip
LONG = CostModel({0: {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3},
                  32768: {1: 1.0, 2: 2.0, 3: 2.9, 4: 3.8}}, batched={1: 1.0, 4: 2.48})  # fmt: skip
POLICY = ModelPolicy("m", {"mtp": "mlx_mtp", "none": "mlx_plain"}, 2, caps={"mtp": 7})
IDLE = LiveState(0, 0, 0)


def req(prompt=100, penalties=False, depth=None) -> RequestFeatures:
    return RequestFeatures(prompt, penalties, None, depth)


def speedup(costs: CostModel, acceptance, depth: int, prompt: int = 0) -> float:
    """MTP at this depth relative to plain decoding, as the policy predicts it."""
    options = candidates(POLICY, ["mtp"], req(prompt=prompt), IDLE, costs, {"mtp": acceptance})
    speed = {(c.method, c.depth): c.speed for c in options}
    return speed[("mtp", depth)] / speed[("none", 0)]


def test_expected_tokens_and_speed():
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([], 3) == 1.0
    # OptiQ's K=1 point comes back out of the pinned curve.
    assert speedup(STOCK_4BIT, ACCEPT, 1) == pytest.approx(1.72 / 1.26)


def test_stock_4bit_curve_chooses_depth_1():
    plan = decide(POLICY, req(), IDLE, STOCK_4BIT, {"mtp": ACCEPT})
    assert (plan.method, plan.depth, plan.reason) == ("mtp", 1, "spec_on")


def test_flat_curve_goes_deeper():
    plan = decide(POLICY, req(), IDLE, FLAT, {"mtp": ACCEPT})
    stock = decide(POLICY, req(), IDLE, STOCK_4BIT, {"mtp": ACCEPT})
    assert plan.method == "mtp" and plan.depth >= 3 > stock.depth
    # With acceptance that does not fall with depth, flat verify goes all the way.
    assert decide(POLICY, req(), IDLE, FLAT, {"mtp": [0.9] * 7}).depth == 7


def test_concurrency_with_batching_above_speculation():
    plan = decide(POLICY, req(), LiveState(3, 0, 0), STOCK_4BIT, {"mtp": ACCEPT})
    assert (plan.method, plan.reason) == ("none", "concurrency")
    # Alone again: back to speculation.
    assert decide(POLICY, req(), IDLE, STOCK_4BIT, {"mtp": ACCEPT}).method == "mtp"


def test_a_stream_near_its_end_stays_where_it_is():
    """A switch costs SWITCH_TOKENS of the engine left: a stream switches only
    where the tokens it has left, at the predicted gain, win them back."""

    def tokens_to_pay(costs, live, incumbent):
        """Tokens left where a switch from `incumbent` to the best plan pays."""
        options = candidates(POLICY, ["mtp"], req(), live, costs, {"mtp": ACCEPT})
        stay = max(c.speed for c in options if c.method == incumbent)
        best = max(c.speed for c in options)
        return SWITCH_TOKENS / (1 - stay / best)

    def plan(costs, live, incumbent, left):
        # 100 prompt tokens, 200 decoded, `left` to go.
        features = RequestFeatures(100, False, max_tokens=200 + left)
        p = decide(POLICY, features, live, costs, {"mtp": ACCEPT}, incumbent)
        return p.method, p.reason

    # Decoding plainly alone, MTP predicted faster.
    alone = LiveState(0, 0, 300)
    needed = tokens_to_pay(FLAT, alone, "none")
    assert plan(FLAT, alone, "none", int(needed) + 1) == ("mtp", "spec_on")
    assert plan(FLAT, alone, "none", int(needed) - 1) == ("none", "near_end")
    # Speculating when three others arrive: batching predicted faster.
    busy = LiveState(3, 0, 300)
    needed = tokens_to_pay(STOCK_4BIT, busy, "mtp")
    assert plan(STOCK_4BIT, busy, "mtp", int(needed) + 1) == ("none", "concurrency")
    assert plan(STOCK_4BIT, busy, "mtp", int(needed) - 1) == ("mtp", "spec_on")
    # A new request (no incumbent), a stream without a bound: the speeds alone.
    one = RequestFeatures(100, False, max_tokens=1)
    assert decide(POLICY, one, IDLE, FLAT, {"mtp": ACCEPT}).method == "mtp"
    assert decide(POLICY, req(), alone, FLAT, {"mtp": ACCEPT}, "none").method == "mtp"


def test_penalties_a_drafter_cannot_apply_per_position():
    p = ModelPolicy("m", {"dflash": "mlx_dflash", "none": "mlx_plain"}, 3,
                    penalty_capable=frozenset({"mtp"}))
    assert decide(p, req(penalties=True), IDLE, FLAT, {"dflash": ACCEPT}).reason == "penalties"
    assert decide(p, req(penalties=False), IDLE, FLAT, {"dflash": ACCEPT}).method == "dflash"


def test_long_context_from_the_cost_curve_and_from_a_threshold():
    assert decide(POLICY, req(prompt=500), IDLE, LONG, {"mtp": ACCEPT}).method == "mtp"
    plan = decide(POLICY, req(prompt=30000), IDLE, LONG, {"mtp": ACCEPT})
    assert (plan.method, plan.reason) == ("none", "long_context")
    capped = ModelPolicy("m", POLICY.engines_by_method, 2, long_context_tokens=8192)
    assert decide(capped, req(prompt=9000), IDLE).reason == "long_context"


def test_measured_loss_and_small_model():
    hopeless = {"mtp": [0.1, 0.1]}
    assert decide(POLICY, req(), IDLE, STOCK_4BIT, hopeless).reason == "measured_loss"
    small = ModelPolicy("m", POLICY.engines_by_method, 2, min_params=4_000_000_000,
                        params=800_000_000)
    assert decide(small, req(), IDLE, FLAT, {"mtp": ACCEPT}).reason == "small_model"


def test_unmeasured_falls_back_to_idle_or_busy():
    assert decide(POLICY, req(), IDLE).header() == "method=mtp;depth=2;reason=spec_on;source=rule"
    assert decide(POLICY, req(), LiveState(1, 0, 0)).reason == "concurrency"


# -- properties ----------------------------------------------------------------

curves = st.lists(st.floats(0.0, 1.5), min_size=7, max_size=7).map(
    lambda steps: {1: 1.0} | {m: 1.0 + sum(steps[: m - 1]) for m in range(2, 9)})  # rising
rates = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8)
batching = st.lists(st.floats(0.0, 1.0), min_size=7, max_size=7).map(
    lambda steps: {1: 1.0} | {b: 1.0 + sum(steps[: b - 1]) for b in range(2, 9)})


@settings(max_examples=300, deadline=None)
@given(curve=curves, long_curve=curves, acc_mtp=rates, acc_dflash=rates, gains=batching,
       active=st.integers(0, 7), prompt=st.integers(1, 40000),
       per_token=st.floats(0.0, 0.3), per_round=st.floats(0.0, 1.0))
def test_chosen_plan_is_never_predicted_slower_than_another_beyond_the_margin(
    curve, long_curve, acc_mtp, acc_dflash, gains, active, prompt, per_token, per_round
):
    costs = CostModel({0: curve, 32768: long_curve}, batched=gains,
                      draft={"mtp": DraftCost(per_token=per_token),
                             "dflash": DraftCost(per_round=per_round)})  # fmt: skip
    policy = ModelPolicy("m", {"mtp": "a", "dflash": "b", "none": "c"}, 2,
                         caps={"mtp": 4, "dflash": 7})  # fmt: skip
    acceptance = {"mtp": acc_mtp, "dflash": acc_dflash}
    live = LiveState(active, 0, 0)
    plan = decide(policy, req(prompt=prompt), live, costs, acceptance)
    options = candidates(policy, ["mtp", "dflash"], req(prompt=prompt), live, costs, acceptance)
    chosen = next(c.speed for c in options if (c.method, c.depth) == (plan.method, plan.depth))
    if plan.method == "none":
        # A new request's default: speculation must be predicted the margin faster.
        assert all(chosen * (1 + SWITCH_MARGIN) >= c.speed for c in options)
        assert plan.reason in ("concurrency", "long_context", "measured_loss")
    else:
        assert all(chosen >= c.speed for c in options)
        assert chosen >= (1 + SWITCH_MARGIN) * next(c.speed for c in options if c.method == "none")
        assert plan.reason == "spec_on"


def test_acceptance_tracker_learns_conditional_rates():
    from specgate.engines.base import RoundStats
    from specgate.policies.acceptance import AcceptanceTracker

    t = AcceptanceTracker(min_rounds=4)
    # Position 1 accepted 3 of 4 times; position 2 reached 3 times, accepted once.
    for flags in ([True, True], [True, False], [True, False], [False, False]):
        t.update(RoundStats("m", "mtp", 2, flags), "code")
    assert t.rates("m", "code") == {"mtp": [0.75]}  # position 2 reached 3 times: not yet trusted
    t.update(RoundStats("m", "mtp", 2, [True, True]), "code")
    rates = t.rates("m", "code")["mtp"]
    assert rates[0] == pytest.approx(4 / 5) and rates[1] == pytest.approx(2 / 4)
    t.update(RoundStats("m", "mtp", 0, []), "code")  # a plain round teaches nothing
    assert t.rates("other", "code") == {}
    # Prose has its own rates: unmeasured until it has its own rounds.
    assert t.rates("m", "prose") == {}


def test_content_class():
    from specgate.policies.content import content_class

    assert content_class("import os\n\ndef main():\n    return os.getcwd()\n") == "code"
    assert content_class("for (int i = 0; i < n; i++) { sum += a[i]; }") == "code"
    assert content_class("Write me a short poem about the sea, please.") == "prose"
    assert content_class("The meeting is at noon. Bring the notes from last week.\n"
                         "Everyone should read the draft before then.") == "prose"
    assert content_class("") == "prose"


def test_fixed_step_costs_turn_a_textbook_win_into_a_measured_loss():
    """`specgate tune` on the demo model (this CPU): a bare forward 11.5 ms,
    a real plain step 7.7 ms, real MTP rounds 13.7/18.1/23.3 ms at depth
    1/2/3. The verify curve alone predicts a win at acceptance 0.6; the
    measured rounds say plain decoding wins, as the replay measured
    (depth 1: 0.87x)."""
    verify = {1: 11.5, 2: 14.9, 3: 17.6, 4: 20.2}
    rounds = {1: 13.7, 2: 18.1, 3: 23.3}
    bare = CostModel({0: {m: s / 11.5 for m, s in verify.items()}})
    assert decide(POLICY, req(), IDLE, bare, {"mtp": [0.6] * 3}).method == "mtp"
    from specgate.kernels.tune import draft_fit

    fit = draft_fit(rounds, verify, 11.5)
    measured = CostModel(bare.verify, draft={"mtp": DraftCost(**fit)}, plain_step=7.7 / 11.5)
    for k, seconds in rounds.items():
        assert speedup(measured, [0.6] * 3, k) == pytest.approx(
            expected_tokens([0.6] * 3, k) * 7.7 / seconds, rel=0.03)
    plan = decide(POLICY, req(), IDLE, measured, {"mtp": [0.6] * 3})
    assert (plan.method, plan.reason) == ("none", "measured_loss")
