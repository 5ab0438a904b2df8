"""Each request's own bound (policies/request_guard.py): what its rounds
really took, against plain decoding, cuts its speculation when it loses.

Pure: the guard's arithmetic directly, then a request's planner driven
round by round with a simulated clock (a round's seconds and committed
tokens are what the simulated engine says, so a time can be asserted:
nothing here is timed for real), then the setting from a YAML config to
the policy the gateway builds.
"""

from __future__ import annotations

import pytest

from specgate.engines.base import LiveState, RoundStats
from specgate.policies.decide import ModelPolicy, RequestFeatures
from specgate.policies.model_policy import LivePolicy, RequestPlanner
from specgate.policies.request_guard import RequestGuard

PLAIN = 0.010  # seconds per plain step
MTP = ModelPolicy("m", {"mtp": "mlx_mtp", "none": "mlx_plain"}, 3)
IDLE = LiveState(0, 0, 0)


def spec(depth, accepted, seconds, context=100) -> RoundStats:
    flags = [j < accepted for j in range(depth)]
    return RoundStats("m", "mtp", depth, flags, depth + 1, seconds, context)


def step(seconds=PLAIN, context=100) -> RoundStats:
    return RoundStats("m", "none", 0, seconds=seconds, context_tokens=context)


def live_policy(**kw) -> LivePolicy:
    return LivePolicy(MTP, live_state=lambda: LiveState(1, 0, 0), timed=frozenset({"mtp", "none"}),
                      **kw)  # fmt: skip


def teach(p: LivePolicy, accepted: int, round_s: float, n: int = 40) -> None:
    """The model-wide estimates: what other requests of this class saw."""
    for _ in range(n):
        p.observe(spec(3, accepted, round_s), "prose")
        p.observe(step(), "prose")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(p: LivePolicy, planner: RequestPlanner, first, n: int, accepted: int,
          round_s: float, handoff_s: float = 0.0) -> tuple[float, list]:  # fmt: skip
    """Decode `n` tokens the way an engine does: a round of the current
    plan, then the planner asked at the boundary. Speculative rounds at any
    depth commit 1 + `accepted` tokens in `round_s`; a plain step one token
    in PLAIN; a change of engine costs `handoff_s`. Returns the simulated
    seconds and every plan."""
    clock = planner.clock
    plan, context, made, plans = first, 100, 0, []
    while made < n:
        if plan.method == "none":
            clock.now += PLAIN
            p.observe(step(context=context), "prose")
            k = 1
        else:
            clock.now += round_s
            k = 1 + min(accepted, plan.depth)
            p.observe(spec(plan.depth, min(accepted, plan.depth), round_s, context), "prose")
        made, context = made + k, context + k
        nxt = planner.plan(LiveState(1, 0, context))
        if nxt.engine != plan.engine:
            clock.now += handoff_s
        plans.append(nxt)
        plan = nxt
    return clock.now, plans


def start(p: LivePolicy) -> tuple:
    plan, planner = p.start(RequestFeatures(20, False), IDLE)
    planner.clock = Clock()
    planner.plan(LiveState(1, 0, 100))  # the engine's first call, after the first token: the mark
    return plan, planner


# -- the guard's arithmetic ------------------------------------------------------


def test_one_unlucky_round_decides_nothing_a_losing_window_does():
    g = RequestGuard(floor=0.9, min_rounds=8, backoff_rounds=32)
    assert g.record(True, 10 * PLAIN, 1, PLAIN) is None  # one stall: not a verdict
    for _ in range(7):
        g.record(True, PLAIN / 4, 1 + 3, PLAIN)  # then rounds that win
    assert g.losses == 0 and not g.blocks()  # the window: 32 tokens in 0.0275 s
    for _ in range(7):
        assert g.record(True, 1.5 * PLAIN, 1, PLAIN) is None
    assert g.record(True, 1.5 * PLAIN, 1, PLAIN) == "request losing: 0.67x plain over 8 rounds"
    assert g.losses == 1 and g.backoff_left == 32


def test_the_backoff_doubles_and_waits_for_the_lost_time_to_fit_the_bound():
    g = RequestGuard(floor=0.9, min_rounds=8, backoff_rounds=32)
    for _ in range(8):
        g.record(True, 4 * PLAIN, 1, PLAIN)  # 0.25x: 24 plain steps lost
    assert g.excess == pytest.approx(24 * PLAIN)
    blocked = 0
    while g.blocks():
        blocked += 1
        g.record(False, PLAIN, 1, PLAIN)
    # Not 32 rounds: until 24 steps are 1/9 of every token's plain time
    # (216 tokens, 8 of them speculated; one more for the float's rounding).
    assert blocked in (208, 209)
    assert g.excess <= g.allowance
    for _ in range(8):
        g.record(True, 1.2 * PLAIN, 1, PLAIN)  # a milder loss: the backoff is what holds it
    assert (g.losses, g.backoff_left) == (2, 64)
    for _ in range(64):
        assert g.blocks()
        g.record(False, PLAIN, 1, PLAIN)
    assert g.backoff_left == 0 and not g.blocks()  # its 64 plain tokens cover the 1.6 steps lost
    for _ in range(8):
        g.record(True, 1.2 * PLAIN, 1, PLAIN)
    assert (g.losses, g.backoff_left) == (3, 128)


def test_no_floor_no_verdict():
    g = RequestGuard(floor=0.0)
    for _ in range(32):
        assert g.record(True, 10 * PLAIN, 1, PLAIN) is None
    assert not g.blocks()


# -- a request's planner ---------------------------------------------------------


@pytest.mark.parametrize("round_s", [0.013, 0.036])
def test_a_request_whose_drafts_are_all_rejected_stops_after_the_window(round_s):
    """The class's estimates say the head wins (3 of 3 accepted), this
    request's drafts are all rejected: its rounds commit one token each at
    1.3x a plain step's cost (3.6x: a 0.28x request), and a handoff costs
    two plain steps. It stops speculating after the guard's window; the
    policy, still trusting the class's estimates, tries again only once the
    request's time fits the bound, so it stays within the bound but for
    the first window."""
    p = live_policy()
    teach(p, accepted=3, round_s=0.013)
    plan, planner = start(p)
    assert plan.method == "mtp"
    n = 512
    seconds, plans = drive(p, planner, plan, n, accepted=0, round_s=round_s, handoff_s=2 * PLAIN)
    window = planner.guard.min_rounds
    assert [q.method for q in plans[:window]] == ["mtp"] * (window - 1) + ["none"]  # the mark's call ran the first
    assert (plans[window - 1].reason, plans[window - 1].source) == ("request_loss", "live")
    assert planner.guard.why.startswith("request losing: 0.")
    speculated = sum(q.method != "none" for q in plans) + 1
    assert speculated <= window * (planner.guard.losses + 1)  # each loss a window, then a last one
    first_window = window * (round_s - PLAIN) + 2 * 2 * PLAIN  # and its two handoffs
    assert n * PLAIN / (seconds - first_window) >= 0.9
    assert n * PLAIN / seconds >= 0.8


def test_a_request_that_wins_keeps_speculating():
    p = live_policy()
    teach(p, accepted=3, round_s=0.013)
    plan, planner = start(p)
    seconds, plans = drive(p, planner, plan, 256, accepted=3, round_s=0.013)
    assert all(q.method == "mtp" for q in plans)
    assert planner.guard.losses == 0
    assert 256 * PLAIN / seconds > 2.5


def test_an_exploring_request_that_loses_is_cut_before_its_hold_ends():
    """Plain decoding wins on the estimates; one idle request in
    `explore_every` tries the head anyway, for 16 rounds. Its rounds lose
    badly (a drafter's cold round and graph builds, say: 4 plain steps
    each): the guard ends the exploration after 8."""
    p = live_policy(explore_every=4)
    teach(p, accepted=0, round_s=0.013)
    for _ in range(8):
        plan, planner = start(p)
        if plan.source == "explore":
            break
    assert (plan.method, plan.source) == ("mtp", "explore") and planner.hold == 16 - 1  # (the mark)
    _, plans = drive(p, planner, plan, 64, accepted=0, round_s=4 * PLAIN)
    assert [q.method for q in plans[:8]] == ["mtp"] * 7 + ["none"]
    assert plans[7].reason == "request_loss" and planner.hold == 0
    assert all(q.method == "none" for q in plans[7:])


def test_the_reference_is_what_plain_rounds_took_between_calls():
    """A lone plain token's cost as planners timed it (engine steps and what
    runs between them) is the reference once measured; before, the
    engines' timed steps."""
    p = live_policy()
    teach(p, accepted=0, round_s=0.013)
    assert p.plain_token_seconds(100) == pytest.approx(PLAIN)
    plan, planner = start(p)
    assert plan.method == "none"
    clock = planner.clock
    for i in range(12):
        clock.now += 1.5 * PLAIN
        planner.plan(LiveState(1, 0, 101 + i))
    assert p.plain_token_seconds(100) == pytest.approx(1.5 * PLAIN)


def test_the_floor_reaches_the_planner_from_yaml(tmp_path):
    from specgate.gateway.config import load_config
    from specgate.gateway.serving.models import ServedModel, _policy, build_context

    path = tmp_path / "specgate.yaml"
    path.write_text("models:\n  - id: m\n    path: x\n    engines: [mlx_plain]\n"
                    "    policy:\n      request_floor: 0.75\n")  # fmt: skip
    config = load_config(path)
    mc = config.models[0]
    served = ServedModel(mc, engines={"mlx_plain": object()})
    policy = _policy(served, build_context(mc, config.llama_server, config.prefix_cache))
    assert policy.request_floor == 0.75
    policy.policy = MTP  # a drafter, so the plan gets a planner
    _, planner = policy.start(RequestFeatures(20, False), IDLE)
    assert planner.guard.floor == 0.75
    path.write_text(path.read_text().replace("0.75", "1.5"))
    with pytest.raises(Exception, match="request_floor"):
        load_config(path)
