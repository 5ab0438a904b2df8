"""The policy learns on the job: live round costs, exploration, and plans
that follow a request's depth and its growing context.

Pure parts (LiveCosts, CostView, Explorer, LivePolicy's planners) are tested
directly; then real gateways with the real openai SDK:
- untuned, on the tiny checkpoint whose random MTP head is (almost) never
  accepted: after a few requests speculation stops (`measured_loss`), and
  only the capped share of exploration speculates again;
- in-process, on the same checkpoint with the head aligned to its trunk
  (acceptance 1), with the costs pinned where speculation wins (failure
  injection: this CPU cannot show a win on a model this small): the policy
  keeps speculating; a depth-only override is every round's depth; a stream
  that grows past `long_context_tokens` goes plain at the next round.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import re

import httpx
import openai
import pytest

from specgate.engines.base import LiveState, RoundStats
from specgate.policies.costs import CostModel
from specgate.policies.decide import SWITCH_MARGIN, ModelPolicy, RequestFeatures, decide
from specgate.policies.explore import Explorer
from specgate.policies.live_costs import STALL_CAP, CostView, LiveCosts
from specgate.policies.model_policy import LivePolicy
from tests.conftest import in_process_gateway, start_gateway, stop_gateway

MTP = ModelPolicy("m", {"mtp": "mlx_mtp", "none": "mlx_plain"}, 3)
IDLE = LiveState(0, 0, 0)


def step(seconds, batch=1, context=100) -> RoundStats:
    return RoundStats("m", "none", 0, seconds=seconds, batch=batch, context_tokens=context)


def spec(depth, accepted, seconds, context=100) -> RoundStats:
    flags = [j < accepted for j in range(depth)]
    return RoundStats("m", "mtp", depth, flags, depth + 1, seconds, context)


# -- live costs -----------------------------------------------------------------


def test_live_costs_skip_the_warm_up_cap_stalls_and_wait_for_samples():
    costs = LiveCosts(min_samples=4)
    costs.observe(step(5.0))  # the shape's first round: graph building, not cost
    for _ in range(3):
        costs.observe(step(0.010))
    assert costs.get("none", 1, 0) is None  # 3 samples: not trusted yet
    costs.observe(step(1.0))  # a stall: counts at most STALL_CAP x the mean
    e = costs.get("none", 1, 0)
    assert e.count == 4 and e.mean == pytest.approx((3 * 0.010 + STALL_CAP * 0.010) / 4)
    costs.observe(RoundStats("m", "mtp", 0, seconds=0.02))  # a depth-0 round: neither plan
    costs.observe(RoundStats("m", "mtp", 2, [True, True]))  # untimed (llama-server): ignored
    assert costs.measured("mtp") == {}


def test_rounds_under_a_grammar_are_costed_apart_from_the_unconstrained_ones():
    p = live_policy()
    for _ in range(10):
        p.observe(spec(2, 0, 0.010), "prose")
    assert p.view(constrained=True).round("mtp", 2, 100).seconds == pytest.approx(0.010)
    for _ in range(10):  # masks and a wait per draft make constrained rounds dearer
        p.observe(RoundStats("m", "mtp", 2, [True, False], 3, 0.030, 100, constrained=True),
                  "structured")
    assert p.view(constrained=True).round("mtp", 2, 100).seconds == pytest.approx(0.030)
    assert p.view().round("mtp", 2, 100).seconds == pytest.approx(0.010)  # untouched
    # ... and their acceptance is the "structured" class's own.
    assert p.acceptance.rates("m", "structured")["mtp"] == [1.0, 0.0]
    assert p.acceptance.rates("m", "prose")["mtp"] == [0.0]


def test_cost_view_prefers_live_then_the_scaled_prior_then_a_line_through_depth_zero():
    live = LiveCosts(min_samples=1)
    view = CostView(live, None)
    assert view.plain(1, 100) is None and view.round("mtp", 2, 100) is None
    for s in (0.01, 0.01):
        live.observe(step(s))
    for s in (0.016, 0.016):
        live.observe(spec(3, 0, s))
    view = CostView(live, None)
    assert view.plain(1, 100).seconds == pytest.approx(0.01)
    # Depth 1 unmeasured: on the line from the plain step (depth 0) to depth 3.
    assert view.round("mtp", 1, 100).seconds == pytest.approx(0.012)
    assert view.round("mtp", 3, 100).source == "live"
    # At 3000 tokens nothing is measured: the nearest bucket's numbers.
    assert view.plain(1, 3000).seconds == pytest.approx(0.01)
    # A prior (c(1) 5 ms) with a machine now twice as slow as when it was tuned:
    # scaled by what both know.
    prior = CostModel({64: {m: 1.0 + 0.2 * (m - 1) for m in range(1, 9)}}, plain_step=1.0,
                      c1_seconds=0.005)  # fmt: skip
    view = CostView(live, prior)
    assert view.round("mtp", 3, 100).seconds == pytest.approx(0.016)  # live wins
    # Depth 1 from the prior's shape, anchored at the measured depth 3.
    assert view.round("mtp", 1, 100).seconds == pytest.approx(0.016 * 1.2 / 1.6)
    two = view.plain(2, 100)  # unmeasured batch: the prior, scaled to now
    assert two.source == "tune" and two.seconds > 0.01


def test_a_round_never_costs_less_than_a_plain_step_so_a_useless_head_never_wins_on_noise():
    """CI once saw a head with no accepted draft chosen by live estimates: its
    depth-1 rounds were timed while the machine was quiet, plain steps since
    it got busier. A round is a plain step's forward and more."""
    p = live_policy()
    for _ in range(20):
        p.observe(spec(1, 0, 0.009), "prose")  # timed quiet
    for _ in range(20):
        p.observe(step(0.010), "prose")  # timed busy
    assert p.view().round("mtp", 1, 100).seconds == pytest.approx(0.010)
    plans = [p.start(RequestFeatures(20, False), IDLE)[0] for _ in range(20)]
    assert all(p.method == "none" or p.source == "explore" for p in plans)


def test_a_head_almost_never_accepted_never_wins_on_noise_either():
    """The floor above makes a round timed quiet cost what a plain step
    timed busy costs; a head accepted 1 draft in 25 then commits ~1.04
    tokens a round, and a new request chose it for that (the Gemma-4
    gateway test's random assistant, after a sampled request had had a few
    drafts accepted). A new request starts speculating only for a plan
    predicted SWITCH_MARGIN faster than plain decoding, as a stream
    switches."""
    p = live_policy()
    for i in range(100):
        p.observe(spec(2, 1 if i % 25 == 24 else 0, 0.009), "prose")  # timed quiet
    for _ in range(20):
        p.observe(step(0.010), "prose")  # timed busy
    assert 0 < p.acceptance.rates("m", "prose")["mtp"][0] < SWITCH_MARGIN
    assert p.view().round("mtp", 2, 100).seconds == pytest.approx(0.010)  # the floor
    plans = [p.start(RequestFeatures(20, False), IDLE)[0] for _ in range(20)]
    assert all(p.method == "none" or p.source == "explore" for p in plans), plans
    # A head that really wins is still chosen: 1 draft in 2 (1.5 tokens a round).
    for i in range(100):
        p.observe(spec(2, i % 2, 0.010), "prose")
    assert p.start(RequestFeatures(20, False), IDLE)[0].method == "mtp"


def test_rounds_speculating_in_a_batch_are_their_own_cost_and_can_beat_plain_batching():
    """Issue 45: a round inside a speculative engine's batch is measured apart
    (it is neither a lone round's nor a plain step's cost), and once its
    shape is measured the policy compares the batch's aggregate with plain
    batching's: busy no longer means plain by rule. Unmeasured, the rule."""

    live = LiveCosts(min_samples=1)
    for _ in range(2):
        live.observe(step(0.010))
        live.observe(step(0.012, batch=2))  # plain: 2 sequences in 12 ms
        live.observe(spec(2, 2, 0.020))  # a lone round: alone, it loses to the batch of 2
    busy = LiveState(1, 0, 100)
    accept = {"mtp": [0.9, 0.9, 0.9]}
    plan = decide(MTP, RequestFeatures(100, False), busy, CostView(live, None), accept)
    assert (plan.method, plan.reason) == ("none", "concurrency")  # batched rounds unmeasured
    # Rounds of two sequences, each drafting 2, verified together in 15 ms;
    # each stream reports the round. The first round is the warm-up (its
    # graph built: 1 s), every stream's report of it skipped.
    for _ in range(2):
        live.observe(RoundStats("m", "mtp", 2, [True, True], 3, 1.0, 100, batch=2))
    assert live.batched("mtp", 2, 2, 0) is None
    for _ in range(2):
        live.observe(RoundStats("m", "mtp", 2, [True, True], 3, 0.015, 100, batch=2))
    assert live.get("mtp", 2, 0).mean == pytest.approx(0.020)  # the lone round's cost unchanged
    view = CostView(live, None)
    assert view.batched_round("mtp", 2, 2, 100).seconds == pytest.approx(0.015)
    # A larger batch, from the nearest measured: scaled by the streams, also
    # where plain steps grow less (a speculative batch's work per stream),
    # by the plain steps where they grow more.
    assert view.batched_round("mtp", 2, 4, 100).seconds == pytest.approx(0.030)
    assert view.batched_round("mtp", 1, 2, 100) is None  # another depth: nothing to scale from
    for _ in range(2):
        live.observe(step(0.018, batch=4))
    assert CostView(live, None).batched_round("mtp", 2, 4, 100).seconds == pytest.approx(0.030)
    for _ in range(2):
        live.observe(step(0.030, batch=3))
    assert CostView(live, None).batched_round("mtp", 2, 3, 100).seconds == pytest.approx(0.015 * 30 / 12)
    plan = decide(MTP, RequestFeatures(100, False), busy, view, accept)
    assert (plan.method, plan.depth, plan.reason) == ("mtp", 2, "spec_on")
    # The same rounds at a low acceptance lose to plain batching.
    plan = decide(MTP, RequestFeatures(100, False), busy, view, {"mtp": [0.1, 0.1, 0.1]})
    assert plan.method == "none"


@pytest.mark.parametrize("second_row, method", [(0.001, "none"), (0.009, "mtp")])
def test_a_lone_round_beside_a_plain_batch_is_priced_with_the_batch_it_holds_up(second_row, method):
    """A sequence speculating alone while another decodes plain takes turns
    with that batch on the model (the engines share its lock): its plan's
    speed is the model's, this round and one step of the others, not its
    own. Where a plain step of 2 costs about one of 1 (a GPU's batch
    through the small-M kernels) that loses to batching the two, though its
    own speed (2.95 tokens in 12 ms) beats batching's aggregate (2 in 11);
    where a second row costs nearly a step (stock batching), it still wins."""
    live = LiveCosts(min_samples=2)
    for _ in range(3):
        live.observe(step(0.010))
        live.observe(step(0.010 + second_row, batch=2))
        for depth in (1, 2, 3):
            live.observe(spec(depth, depth, 0.009 + 0.001 * depth))
    accept = {"mtp": [0.8, 0.8, 0.8]}
    one_other = LiveState(1, 0, 100)
    plan = decide(MTP, RequestFeatures(100, False), one_other, CostView(live, None), accept)
    assert plan.method == method
    if method == "none":
        assert plan.reason == "concurrency"  # alone, it would speculate
        assert decide(MTP, RequestFeatures(100, False), IDLE, CostView(live, None), accept).method == "mtp"


def test_the_tune_prior_costs_a_batched_round_until_one_is_measured():
    """Before any batched round ran, `specgate tune`'s curve prices one: a
    forward of batch x (depth + 1) rows plus each sequence's drafting. Where
    verify rows are nearly free (a GPU through the kernels) a busy model
    speculates in a batch from the start; where they cost what they
    compute (a CPU) it batches plainly; past the widths tune measured the
    prior says nothing."""
    from specgate.policies.costs import DraftCost

    def prior(verify_row: float) -> CostModel:
        curve = {m: 1 + verify_row * (m - 1) for m in range(1, 17)}
        return CostModel(verify={64: curve, 4096: curve}, draft={"mtp": DraftCost(0.1, 0.05)},
                         batched={b: b / (1 + 0.05 * (b - 1)) for b in range(1, 17)},
                         plain_step=1.1, c1_seconds=0.010)  # fmt: skip

    busy, accept = LiveState(3, 0, 100), {"mtp": [0.8, 0.8, 0.8]}  # a batch of 4 with this one
    gpu = CostView(LiveCosts(), prior(0.02))
    est = gpu.batched_round("mtp", 2, 4, 100)
    assert est.source == "tune"
    assert est.seconds == pytest.approx(0.010 * (1 + 0.02 * 11 + 4 * 0.2))
    assert gpu.batched_round("mtp", 4, 4, 100) is None  # 20 rows: past the 16 measured
    assert gpu.batched_round("ngram", 2, 4, 100) is None  # its rounds were never timed
    plan = decide(MTP, RequestFeatures(100, False), busy, gpu, accept)
    assert (plan.method, plan.reason, plan.source) == ("mtp", "spec_on", "tune")
    # 16 streams: even one draft each is 32 rows, past what tune measured
    # (and past the engine's batch of 8): plain batching, by the same rule.
    plan = decide(MTP, RequestFeatures(100, False), LiveState(15, 0, 100), gpu, accept)
    assert (plan.method, plan.reason) == ("none", "concurrency")
    # An engine that cannot batch its rounds (Gemma-4's windows, a quantized
    # KV cache) would run the four one after another: no batched price for it.
    alone = dataclasses.replace(MTP, batching=frozenset())
    plan = decide(alone, RequestFeatures(100, False), busy, gpu, accept)
    assert (plan.method, plan.reason) == ("none", "concurrency")
    cpu = CostView(LiveCosts(), prior(0.5))  # alone, speculation would still win
    assert decide(MTP, RequestFeatures(100, False), LiveState(0, 0, 100), cpu, accept).method == "mtp"
    plan = decide(MTP, RequestFeatures(100, False), busy, cpu, accept)
    assert (plan.method, plan.reason) == ("none", "concurrency")


def test_a_busy_model_tries_speculating_in_a_batch_then_keeps_what_measures_faster():
    """Issue 45: untuned, a busy model batches plainly by rule, and no lone
    request ever times a batch's round. A batch trial moves the busy
    requests onto MTP at depth 1 together (new ones, and plain streams with
    enough left at their next round) until TRIAL_ROUNDS batched rounds were
    seen; then the measure decides, and a loser is tried again less and
    less often."""
    from specgate.engines.base import Plan
    from specgate.policies.model_policy import TRIAL_MIN_LEFT, TRIAL_ROUNDS, RequestPlanner

    def trained(batched_s: float) -> LivePolicy:
        p = LivePolicy(MTP, live_state=lambda: LiveState(4, 0, 100), timed=frozenset({"mtp", "none"}))
        teach(p, accepted=1, round_s=0.012, plain_s=0.010, depth=1)  # acceptance known, alone
        for _ in range(8):
            p.observe(step(0.014, batch=4), "prose")  # plain: 4 sequences in 14 ms
        return p

    busy, features = LiveState(3, 0, 100), RequestFeatures(100, False, max_tokens=200)
    for batched_s, winner in ((0.016, "mtp"), (0.040, "none")):
        p = trained(batched_s)
        plan, _ = p.start(features, busy)
        assert (plan.method, plan.depth, plan.source) == ("mtp", 1, "explore")
        # A plain stream moves over at its next round; one near its end stays.
        mover = RequestPlanner(p, features, Plan("mlx_plain", "none", 0, "concurrency"))
        assert mover.plan(LiveState(1, 0, 150)).method == "mtp"
        near = RequestFeatures(100, False, max_tokens=100 + TRIAL_MIN_LEFT - 1)
        assert p.next_round(near, LiveState(3, 0, 200), "none").method == "none"
        # Streams already on MTP stay there while the trial runs, then the measure decides.
        assert p.next_round(features, LiveState(3, 0, 150), "mtp").method == "mtp"
        for _ in range(TRIAL_ROUNDS):
            p.observe(RoundStats("m", "mtp", 1, [True], 2, batched_s, 150, batch=4), "prose")
        plan = p.next_round(features, LiveState(3, 0, 150), "mtp")
        assert plan.method == winner and plan.source == "live"
        starts = []
        for _ in range(64):
            starts.append(p.start(features, busy)[0])
            if starts[-1].source == "explore":  # the trial's batch runs its rounds
                for _ in range(TRIAL_ROUNDS):
                    p.observe(RoundStats("m", "mtp", 1, [True], 2, batched_s, 150, batch=4), "prose")
        if winner == "mtp":  # 4 x 1.5 tokens in 16 ms beats 4 in 14 ms
            assert {(x.method, x.reason, x.source) for x in starts} == {("mtp", "spec_on", "live")}
        else:  # the loser: tried again only once in a capped share of busy starts
            trials = [x for x in starts if x.method == "mtp"]
            assert 1 <= len(trials) <= 64 / 64 + 1 and {x.source for x in trials} == {"explore"}
            assert {(x.method, x.reason) for x in starts if x.method == "none"} == {("none", "concurrency")}
    # Where lone rounds already say a batch cannot win, no trial is run:
    # alone speculation wins (2 tokens in 12 ms against 1 in 10), but a
    # draft and a row cost 2 ms over a plain step, and 4 x 2 tokens in at
    # most 4.5 + 4 x 2 ms lose to plain batching's 4 in 4.5 ms.
    hopeless = LivePolicy(MTP, live_state=lambda: busy, timed=frozenset({"mtp", "none"}))
    teach(hopeless, accepted=1, round_s=0.012, plain_s=0.010, depth=1)
    for _ in range(8):
        hopeless.observe(step(0.0045, batch=4), "prose")
    assert hopeless.start(features, IDLE)[0].method == "mtp"
    # Nor where the bound wins by less than TRIAL_MARGIN: 4 x 2 tokens in at
    # most 9 + 4 x 2 ms beat 4 in 9 ms by 6 %.
    marginal = LivePolicy(MTP, live_state=lambda: busy, timed=frozenset({"mtp", "none"}))
    teach(marginal, accepted=1, round_s=0.012, plain_s=0.010, depth=1)
    for _ in range(8):
        marginal.observe(step(0.009, batch=4), "prose")
    assert {marginal.start(features, busy)[0].method for _ in range(20)} == {"none"}
    assert {hopeless.start(features, busy)[0].method for _ in range(20)} == {"none"}
    # A trial begun at 2 streams (2 x 2 tokens in at most 8 + 2 x 2 ms may
    # beat 2 in 8 by the margin) ends once the batch grows past what lone
    # rounds let it win at: 8 x 2 tokens in at most 12 + 8 x 2 ms lose to
    # plain batching's 8 in 12 ms (a burst's first arrivals see it small).
    growing = LivePolicy(MTP, live_state=lambda: busy, timed=frozenset({"mtp", "none"}))
    teach(growing, accepted=1, round_s=0.012, plain_s=0.010, depth=1)
    for _ in range(8):
        growing.observe(step(0.008, batch=2), "prose")
        growing.observe(step(0.012, batch=8), "prose")
    assert growing.start(features, LiveState(1, 0, 100))[0].source == "explore"
    assert growing.next_round(features, LiveState(1, 0, 150), "mtp").method == "mtp"
    assert growing.start(features, LiveState(7, 0, 100))[0].method == "none"
    assert growing.next_round(features, LiveState(7, 0, 150), "mtp").method == "none"  # it ended
    # A configured concurrency threshold is the whole rule: no trials.
    ruled = LivePolicy(dataclasses.replace(MTP, concurrency_threshold=2), live_state=lambda: busy,
                       timed=frozenset({"mtp", "none"}))  # fmt: skip
    teach(ruled, accepted=1, round_s=0.012, plain_s=0.010, depth=1)
    assert {ruled.start(features, busy)[0].method for _ in range(20)} == {"none"}


def test_a_batch_past_the_engine_s_is_priced_at_the_engine_s():
    """16 requests on an engine that speculates for 8 at a time: the
    aggregate is those 8's, the rest waiting (SpecEngine.max_batch)."""
    from specgate.policies.costs import expected_tokens
    from specgate.policies.decide import candidates

    live = LiveCosts(min_samples=1)
    for _ in range(2):
        live.observe(step(0.050, batch=16))
        live.observe(step(0.015, batch=8))
    for _ in range(2 * 8):  # two rounds of 8 streams: the warm-up, then one sample
        live.observe(RoundStats("m", "mtp", 1, [True], 2, 0.020, 100, batch=8))
    capped = dataclasses.replace(MTP, batch_caps={"mtp": 8})
    accept = {"mtp": [0.8]}
    found = [c for c in candidates(capped, ["mtp"], RequestFeatures(100, False), LiveState(15, 0, 100),
                                   CostView(live, None), accept) if c.method == "mtp"]  # fmt: skip
    assert [c.speed for c in found] == [pytest.approx(8 * expected_tokens([0.8], 1) / 0.020)]


def test_explorer_tries_what_is_unmeasured_at_once_then_a_capped_share():
    ex = Explorer(every=16, max_every=64, unmeasured_tries=2)
    assert ex.choose("mtp", {"mtp": False, "none": False}) == "none"  # nothing known: try it
    assert ex.choose("mtp", {"mtp": True, "none": False}) == "none"
    assert ex.choose("mtp", {"mtp": True, "none": False}) is None  # tries used up: wait
    picks = [ex.choose("none", {"mtp": True, "none": True}) for _ in range(200)]
    explored = [i for i, p in enumerate(picks) if p is not None]
    assert set(picks) == {None, "mtp"}
    assert len(explored) <= 200 / 16
    gaps = [b - a for a, b in zip(explored, explored[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == 64  # a loser is tried less and less often
    assert Explorer(every=0).choose("none", {"mtp": False, "none": True}) is None  # off


# -- the planner ------------------------------------------------------------------


def live_policy(policy=MTP, **kw) -> LivePolicy:
    return LivePolicy(policy, live_state=lambda: LiveState(1, 0, 0), timed=frozenset({"mtp", "none"}),
                      **kw)  # fmt: skip


def teach(p: LivePolicy, accepted: int, round_s: float, plain_s: float, depth: int = 3, n: int = 20):
    for _ in range(n):
        p.observe(spec(depth, accepted, round_s), "prose")
        p.observe(step(plain_s), "prose")


def test_a_losing_head_stops_being_used_and_a_winning_one_is_kept():
    loser = live_policy()
    teach(loser, accepted=0, round_s=0.012, plain_s=0.010)
    plans = [loser.start(RequestFeatures(20, False), IDLE)[0] for _ in range(64)]
    assert sum(p.method == "mtp" for p in plans) <= 64 / 16
    assert all(p.source == "explore" for p in plans if p.method == "mtp")
    assert {(p.reason, p.source) for p in plans if p.method == "none"} == {("measured_loss", "live")}

    winner = live_policy()
    teach(winner, accepted=3, round_s=0.012, plain_s=0.010)
    plans = [winner.start(RequestFeatures(20, False), IDLE)[0] for _ in range(64)]
    assert sum(p.method == "none" for p in plans) <= 64 / 16
    assert {(p.reason, p.source) for p in plans if p.method == "mtp"} == {("spec_on", "live")}


def test_a_forced_depth_is_every_rounds_depth():
    p = live_policy()
    teach(p, accepted=3, round_s=0.012, plain_s=0.010)
    plan, planner = p.start(RequestFeatures(20, False, forced_depth=1), IDLE)
    assert (plan.method, plan.depth) == ("mtp", 1)
    assert {planner.plan(LiveState(1, 0, 20 + i)).depth for i in range(50)} == {1}


def test_the_growing_context_is_planned_for():
    p = live_policy(ModelPolicy("m", MTP.engines_by_method, 3, long_context_tokens=100))
    teach(p, accepted=3, round_s=0.012, plain_s=0.010)
    plan, planner = p.start(RequestFeatures(90, False), IDLE)
    assert plan.method == "mtp"
    assert planner.plan(LiveState(1, 0, 100)).method == "mtp"
    assert planner.plan(LiveState(1, 0, 101)).header() == (
        "method=none;depth=0;reason=long_context;source=rule")
    # Costs that grow with context: speculation wins short and loses long.
    q = live_policy()
    for _ in range(20):
        q.observe(spec(3, 1, 0.012, context=100), "prose")
        q.observe(step(0.010, context=100), "prose")
        q.observe(spec(3, 1, 0.080, context=5000), "prose")
        q.observe(step(0.011, context=5000), "prose")
    plan, planner = q.start(RequestFeatures(100, False), IDLE)
    assert plan.method == "mtp"
    assert planner.plan(LiveState(1, 0, 5000)).header() == (
        "method=none;depth=0;reason=long_context;source=live")


# -- real gateways -------------------------------------------------------------------


def headers(raw) -> dict[str, str]:
    return dict(item.split("=") for item in raw.headers["x-specgate-plan"].split(";"))


def counter(base_url: str, name: str, **labels) -> float:
    text = httpx.get(base_url + "/metrics").text
    total = 0.0
    for m in re.finditer(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def complete(client: openai.OpenAI, model: str, prompt, n: int = 24, **headers_):
    return client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers=headers_)


def test_untuned_model_stops_speculating_with_a_useless_head(tiny_model, tmp_path):
    """No `specgate tune`, a head whose drafts are never accepted: after at
    most 5 requests, at most 1 in 10 speculates (exploration), the rest are
    `measured_loss` from live estimates."""
    gw = start_gateway({"models": [{"id": "m", "path": str(tiny_model), "max_context": 2048,
                                    "engines": ["mlx_plain", "mlx_mtp"], "mtp_depth": 3}]},
                       tmp_path)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
        plans = [headers(complete(client, "m", [7, 8, 9, i])) for i in range(25)]
    finally:
        stop_gateway(gw)
    later = plans[5:]
    print("\n" + "\n".join(f"{p['method']} {p['reason']} {p['source']}" for p in plans))
    assert sum(p["method"] == "mtp" for p in later) <= len(later) / 10
    assert all(p["source"] == "explore" for p in later if p["method"] == "mtp")
    assert all((p["reason"], p["source"]) == ("measured_loss", "live")
               for p in later if p["source"] != "explore")  # fmt: skip


class PinnedCosts(LiveCosts):
    """Failure injection: the live-cost estimates as if this machine had
    measured a plain step at 10 ms and an MTP round at 10 + 1 ms per draft,
    whatever it really measures (a CPU running a model this small cannot
    show speculation winning)."""

    def get(self, method, width, bucket):
        from specgate.policies.live_costs import RunningEstimate

        seconds = 0.010 * width if method == "none" else 0.010 + 0.001 * width
        return RunningEstimate(mean=seconds, count=self.min_samples, warm_up=0)

    def measured(self, method, bucket=None):
        return {(w, 0): self.get(method, w, 0) for w in range(1, 4)}


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """An in-process gateway (real uvicorn on loopback) serving the aligned
    head twice: "a" plain policy, "long" with long_context_tokens 64; both
    with PinnedCosts, and no request bound."""
    from specgate.builders.tiny import build_qwen35_hybrid

    tmp = tmp_path_factory.mktemp("aligned")
    path = build_qwen35_hybrid(tmp / "qwen35-aligned", seed=0, aligned_mtp=True)
    model = {"path": str(path), "max_context": 2048, "engines": ["mlx_plain", "mlx_mtp"],
             "mtp_depth": 3}
    # No request bound: it judges rounds by the wall clock, which on this CPU
    # shows the loss the pinned costs hide (tests/test_request_guard.py tests it).
    unbound = {"request_floor": 0}
    config = {"models": [{"id": "a", **model, "policy": unbound},
                         {"id": "long", **model, "policy": {"long_context_tokens": 64, **unbound}}]}
    with in_process_gateway(config, tmp / "home") as (app, base):
        for served in app.state.registry.models.values():
            served.policy.costs = PinnedCosts()
        yield base


def test_aligned_head_where_speculation_wins_keeps_speculating(aligned):
    client = openai.OpenAI(base_url=aligned + "/v1", api_key="none", max_retries=0, timeout=120)
    plans = [headers(complete(client, "a", [7, 8, 9, i])) for i in range(20)]
    later = plans[3:]
    assert sum(p["method"] == "none" for p in later) <= len(later) / 10
    assert all((p["method"], p["reason"], p["source"]) == ("mtp", "spec_on", "live")
               for p in later if p["source"] != "explore")  # fmt: skip
    # Every draft accepted: the aligned head really is aligned.
    drafted = counter(aligned, "specgate_spec_decode_num_draft_tokens_total", model="a")
    assert drafted > 0
    assert counter(aligned, "specgate_spec_decode_num_accepted_tokens_total", model="a") == drafted


def test_depth_only_override_is_the_depth_of_every_round(aligned):
    client = openai.OpenAI(base_url=aligned + "/v1", api_key="none", max_retries=0, timeout=120)
    for _ in range(3):  # past the first requests' exploration
        complete(client, "a", [1, 2, 3])
    rounds = counter(aligned, "specgate_spec_decode_num_drafts_total", model="a")
    drafted = counter(aligned, "specgate_spec_decode_num_draft_tokens_total", model="a")
    raw = complete(client, "a", [4, 5, 6], n=40, **{"X-Specgate-Depth": "1"})
    assert headers(raw)["depth"] == "1"
    rounds = counter(aligned, "specgate_spec_decode_num_drafts_total", model="a") - rounds
    drafted = counter(aligned, "specgate_spec_decode_num_draft_tokens_total", model="a") - drafted
    assert rounds >= 20 and drafted == rounds  # one draft in every round, none deeper


def test_a_stream_growing_past_long_context_goes_plain_at_the_next_round(aligned):
    client = openai.OpenAI(base_url=aligned + "/v1", api_key="none", max_retries=0, timeout=120)
    before = counter(aligned, "specgate_plan_decisions_total", model="long", method="none",
                     reason="long_context")  # fmt: skip
    plain_before = counter(aligned, "specgate_generation_tokens_total", model="long", method="none")
    spec_before = counter(aligned, "specgate_generation_tokens_total", model="long", method="mtp")
    raw = complete(client, "long", list(range(10, 50)), n=60)  # 40 prompt tokens: below 64
    assert headers(raw)["method"] == "mtp"
    assert raw.parse().usage.completion_tokens == 60
    assert counter(aligned, "specgate_plan_decisions_total", model="long", method="none",
                   reason="long_context") == before + 1  # fmt: skip
    spec = counter(aligned, "specgate_generation_tokens_total", model="long", method="mtp") - spec_before
    plain = counter(aligned, "specgate_generation_tokens_total", model="long", method="none") - plain_before
    # Speculation until the context passed 64 (at most one round of 4 beyond), plain after.
    assert 24 <= spec <= 28 and spec + plain == 60


def test_a_tune_file_written_while_serving_is_used_by_the_next_request(tiny_model, tmp_path):
    """No restart: the plan after the file appears counts on its numbers
    (source=tune: plain decoding's cost, never run here, comes from it)."""
    from specgate.kernels import tune

    home = tmp_path / "home"
    gw = start_gateway({"models": [{"id": "m", "path": str(tiny_model), "max_context": 2048,
                                    "engines": ["mlx_plain", "mlx_mtp"], "mtp_depth": 3,
                                    "policy": {"explore_every": 0}}]},
                       tmp_path, home=home)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)
        complete(client, "m", [7, 8, 9], n=32, **{"X-Specgate-Method": "mtp"})  # acceptance, round costs
        before = headers(complete(client, "m", [7, 8, 10]))
        c1 = 0.004
        verify = {ctx: {m: c1 * (1 + 0.1 * (m - 1)) for m in range(1, 17)} for ctx in (64, 1024, 4096)}
        batched = {b: c1 * (1 + 0.2 * (b - 1)) for b in range(1, 9)}
        rounds = {"mtp": {k: c1 * (1.2 + 0.2 * k) for k in range(1, 9)}}
        tune.save(tune.measurements(verify, batched, rounds, str(tiny_model)),
                  tune.tune_path(tiny_model, home))
        after = headers(complete(client, "m", [7, 8, 11]))
    finally:
        stop_gateway(gw)
    assert before["source"] == "rule"  # plain decoding's cost unknown: the idle rule
    assert after["source"] == "tune", after


def test_a_burst_counts_requests_not_yet_in_an_engine():
    """The second request of a burst is planned before the first reached its
    engine: holding a slot (or queued for one) it counts, so the second
    batches instead of starting a speculative prefill."""
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving.models import ServedModel
    from specgate.policies.model_policy import LivePolicy

    served = ServedModel(parse_config({"models": [{"id": "m", "path": "x", "max_concurrent": 1}]}).models[0])
    policy = LivePolicy(MTP, live_state=served.planning_state)
    assert policy.start(RequestFeatures(20, False), served.planning_state())[0].method == "mtp"
    assert served.gate.reserve("k") is None  # the first holds the slot, not yet in an engine
    plan, _ = policy.start(RequestFeatures(20, False), served.planning_state())
    assert (plan.method, plan.reason) == ("none", "concurrency")

    async def third():  # queued for the slot (a waiting place is a future)
        served.gate.reserve("k")
        return served.planning_state()

    assert asyncio.run(third()) == LiveState(1, 1, 0)


def test_a_burst_counts_requests_still_rendering():
    """In a burst the first request is planned while the others are still
    being read, rendered and tokenized (they hold the model, `in_use`, and
    no slot yet): they count, so it batches with them instead of starting
    alone on a speculative engine and handing off a round later (the
    batch_policy bench's 4-stream bursts lost 7 % to that). The request
    being planned is not one of its own others; nor is one whose answer is
    being sent after its slot went back."""
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving import models
    from specgate.gateway.serving.models import ServedModel
    from specgate.policies.model_policy import LivePolicy

    served = ServedModel(parse_config({"models": [{"id": "m", "path": "x", "max_concurrent": 4}]}).models[0])
    policy = LivePolicy(MTP, live_state=served.planning_state)
    served.in_use = 1  # the request being planned alone
    assert served.planning_state(arriving=True) == LiveState(0, 0, 0)
    assert policy.start(RequestFeatures(20, False), served.planning_state(arriving=True))[0].method == "mtp"
    served.in_use = 3  # two more arrived, still rendering
    assert served.planning_state(arriving=True) == LiveState(0, 2, 0)
    plan, _ = policy.start(RequestFeatures(20, False), served.planning_state(arriving=True))
    assert (plan.method, plan.reason) == ("none", "concurrency")
    assert served.gate.reserve("k") is None  # one of them takes a slot: holding, not arriving
    assert served.planning_state(arriving=True) == LiveState(1, 1, 0)
    assert served.planning_state() == LiveState(1, 2, 0)  # a round's planner: all others count

    def answered():  # (in an HTTP request's context, as ModelLeases gives it)
        models._leases.set(models._Lease())
        served.gate.release()  # decoded to its end: its slot went back, as generation.run does,
        models.answering(served, True)  # its answer still on its way (it holds the model)
        return served.planning_state()

    # Neither holding nor arriving: counted as arriving, it sent a stream it
    # had left alone back to batching for a round (test_plan_switch, once).
    assert contextvars.copy_context().run(answered) == LiveState(0, 2, 0)
