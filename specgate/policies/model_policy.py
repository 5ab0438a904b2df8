"""One model's policy as it serves: built from its config, learning as it goes.

The gateway hands each request to `LivePolicy.start`, which returns the
first plan and the planner its engines ask again at every round, and feeds
every RoundStats back through `observe`. The pieces it joins:
- `ModelPolicy` (policies/decide.py): what the config and the engines allow;
- live acceptance per draft position (policies/acceptance.py);
- live round costs (policies/live_costs.py), with `specgate tune`'s results
  as the prior, read through `prior()` at every decision, so a tune run
  while the server runs is used by the next request;
- exploration (policies/explore.py) on idle requests, and batch trials on
  busy ones (below): under concurrency, speculating in the engine's batch
  is measured before plain batching is preferred to it;
- each request's own bound (policies/request_guard.py): what its rounds
  really took, against plain decoding, cuts its speculation when it loses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from specgate.engines import registry
from specgate.engines.base import LiveState, Method, Plan, RoundStats
from specgate.engines.registry import BuildContext
from specgate.policies.acceptance import AcceptanceTracker
from specgate.policies.config import PolicyConfig
from specgate.policies.content import CONTENT_CLASSES, ContentClass
from specgate.policies.costs import CostModel, expected_tokens
from specgate.policies.decide import FixedPlanner, ModelPolicy, RequestFeatures, candidates, decide
from specgate.policies.explore import Explorer
from specgate.policies.live_costs import CostView, LiveCosts, context_bucket
from specgate.policies.request_guard import RequestGuard

log = logging.getLogger("specgate.policy")

# Plans whose reason cannot change while the request runs: no need to ask again.
_FIXED_REASONS = ("forced_by_request", "no_drafter", "penalties", "small_model")

# A batch trial: while the model is busy and a batching speculative method's
# rounds in a batch are not measured (or are due again, as Explorer decides
# for idle requests), the model's busy requests speculate with it at depth 1
# together (the ones arriving, and the plain streams at their next round),
# until a batch size's round is measured (live_costs.LiveCosts.batched), or
# at most TRIAL_ROUNDS reports of its streams' rounds in a batch came in.
# Without it, concurrency is plain by rule forever: no request alone ever
# times a batch's round. Depth 1: the cheapest round and the widest batch
# its verify widths fit. A stream with less than TRIAL_MIN_LEFT tokens left
# stays where it is (the handoff would not pay).
TRIAL_ROUNDS = 48
TRIAL_MIN_LEFT = 16
# A trial's cost is certain, its gain only possible: it runs only where the
# bound (_batch_may_win) promises a batch this much faster than plain
# batching. Lone rounds near break-even on this CPU put 2 streams at the
# edge, where noise began a trial in 3 of 10 bursts (0.92x those bursts).
# On an H100 a lone depth-1 round costs little over a plain step (the
# verify kernels) while a plain step of 2 to 16 streams took 9.5 to 51 ms:
# the bound is far past the margin there.
TRIAL_MARGIN = 0.25


@dataclass
class _Trial:
    plan: Plan
    rounds_left: int = TRIAL_ROUNDS
    decisions_left: int = 8 * TRIAL_ROUNDS  # ends it where no batch forms after all


def build_policy(model_id: str, engines: Mapping[str, object], refused: Mapping[str, str],
                 config: PolicyConfig, *, context: BuildContext,
                 params: int | None) -> ModelPolicy:  # fmt: skip
    """The model's ModelPolicy from its config, the engines it got (each
    described by its engines/registry.py record) and the settings they were
    built with."""
    # Speculative methods in the order the engines were built, plain decoding last.
    order = sorted(engines, key=lambda name: not registry.record(name).speculative)
    methods = {registry.method_of(name): name for name in order}
    refused_methods = {registry.method_of(name): why for name, why in refused.items()}
    # Depths set when the engine starts (llama-server's --spec-draft-n-max).
    fixed = tuple(registry.method_of(n) for n in order if registry.record(n).fixed_depth)
    depths, caps = {}, {}
    for name in order:
        record = registry.record(name)
        if record.depth_cap is not None:
            caps[record.method] = record.depth_cap(engines[name])
        if record.depth is not None:
            depths[record.method] = record.depth(context.settings_of(name), engines[name])
    if isinstance(config.depth, int):  # a fixed depth for every method a request may set
        for method in depths:
            if method not in fixed:
                depths[method] = min(config.depth, caps.get(method, config.depth))
    return ModelPolicy(
        model_id, methods, max(depths.values(), default=0), refused_methods, fixed, depths, caps,
        penalty_capable=frozenset() if config.penalties == "plain" else None,
        long_context_tokens=_number(config.long_context_tokens),
        min_params=config.min_params,
        params=params,
        auto_depth=config.depth == "auto",
        concurrency_threshold=_number(config.concurrency_threshold),
        allow_overrides=config.allow_overrides,
        proving=lambda: frozenset(m for m, name in methods.items()
                                  if registry.proving(engines[name])),  # fmt: skip
        batching=frozenset(m for m, name in methods.items() if registry.batches(engines[name])),
        batch_caps={m: cap for m, name in methods.items()
                    if (cap := registry.max_batch(engines[name])) is not None},  # fmt: skip
    )


def _batch_may_win(view: CostView, acceptance, method: Method, batch: int, context: int) -> bool:
    """Whether speculating at depth 1 in a batch of `batch` could beat plain
    batching by TRIAL_MARGIN, judged from what lone rounds measured: a batch's round costs
    at most a plain step of the batch plus, per stream, what a lone round
    costs over a lone plain step (its draft and its verify row; in a batch
    both cost less or as much: the verify curve only flattens). Where even
    that bound wins, or nothing is known yet, a trial may find out; where
    it loses (a CPU, on which rows cost what they compute), none is run."""
    lone, one = view.round(method, 1, context), view.plain(1, context)
    if not acceptance or lone is None or one is None:
        return True
    many = view.plain(batch, context)
    # Unmeasured, a plain step of the batch is at most its streams' steps one by one.
    step = many.seconds if many is not None else batch * one.seconds
    # batch x E / (step + batch x extra) > (1 + margin) x batch / step, rearranged:
    gain = step * (expected_tokens(acceptance, 1) - 1 - TRIAL_MARGIN)
    return gain > (1 + TRIAL_MARGIN) * batch * (lone.seconds - one.seconds)


def capable_of(policy: ModelPolicy, method: Method) -> bool:
    """Whether `method`'s drafter applies sampling penalties per position."""
    return policy.penalty_capable is None or method in policy.penalty_capable


def timed_methods(engines: Mapping[str, object]) -> frozenset[Method]:
    """Methods whose engines time every round (the in-process ones; llama-server
    reports sums), so their costs can be learned live."""
    return frozenset(registry.method_of(name) for name in engines
                     if registry.record(name).times_rounds)  # fmt: skip


def _number(value: str | int) -> int | None:
    return value if isinstance(value, int) else None  # "auto": the cost model's call


class LivePolicy:
    """A model's policy and everything it has learned. Thread-safe: planners
    run on engine worker threads, `observe` on the event loop."""

    def __init__(self, policy: ModelPolicy, *, live_state: Callable[[], LiveState],
                 prior: Callable[[], CostModel | None] = lambda: None,
                 timed: frozenset[Method] = frozenset(), explore_every: int = 16,
                 request_floor: float = 0.9):  # fmt: skip
        self.policy = policy
        self.live_state = live_state  # the model's engines together, this request included
        self.prior = prior
        self.timed = timed
        self.acceptance = AcceptanceTracker()
        self.costs = LiveCosts()
        # Rounds under a grammar wait for their drafts and compute masks: their
        # costs are learned apart, starting from the unconstrained ones.
        self.constrained_costs = LiveCosts(fallback=self.costs)
        self._explorers = {c: Explorer(every=explore_every) for c in CONTENT_CLASSES}
        # Busy starts come in bursts (a burst of B is B - 1 of them), and a
        # trial moves the whole batch: tried a quarter as often as idle ones.
        self._batch_explorers = {c: Explorer(every=4 * explore_every, max_every=64 * explore_every)
                                 for c in CONTENT_CLASSES}  # fmt: skip
        self._trial: _Trial | None = None
        self.request_floor = request_floor  # policies/request_guard.py; 0: no bound
        # Seconds per token of idle plain rounds as requests' planners saw
        # them (wall time between calls, the way they time speculation too).
        self.realised_plain = LiveCosts()
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self.policy.model_id

    def observe(self, stats: RoundStats, content: ContentClass) -> None:
        with self._lock:
            self.acceptance.update(stats, content)
            (self.constrained_costs if stats.constrained else self.costs).observe(stats)
            trial = self._trial
            if trial is not None and stats.batch > 1 and stats.method == trial.plan.method:
                trial.rounds_left -= 1
                measured = self.costs.batches_measured(stats.method, 1, context_bucket(stats.context_tokens))
                if trial.rounds_left <= 0 or measured:  # what it ran for is known
                    self._trial = None

    def view(self, constrained: bool = False) -> CostView | None:
        """The round costs to plan with, or None when nothing can be known
        (no prior and no engine that times its rounds)."""
        prior = self.prior()
        costs = self.constrained_costs if constrained else self.costs
        return CostView(costs, prior) if prior is not None or self.timed else None

    def start(self, features: RequestFeatures, live: LiveState) -> tuple[Plan, RequestPlanner | FixedPlanner]:
        """The plan a new request starts on, and its planner (raises
        OverrideError on a bad override)."""
        with self._lock:
            acceptance = self.acceptance.rates(self.model_id, features.content)
            view = self.view(features.constrained)
            plan = decide(self.policy, features, live, view, acceptance)
            if plan.reason in _FIXED_REASONS:
                return plan, FixedPlanner(plan)
            explored = self._explore(plan, features, live, view, acceptance)
            hold = self._explorers[features.content].hold_rounds if explored else 0
            explored = explored or self._batch_trial(plan, features, live, view, acceptance, start=True)
        bounded = self.request_floor > 0 and "none" in self.policy.engines_by_method
        guard = RequestGuard(self.request_floor) if bounded else None
        return explored or plan, RequestPlanner(self, features, explored or plan, hold, guard)

    def _batch_trial(self, plan: Plan, features: RequestFeatures, live: LiveState,
                     view: CostView | None, acceptance, *, start: bool = False,
                     incumbent: Method | None = None) -> Plan | None:  # fmt: skip
        """The trial's plan for a busy request that `plan` sends to plain
        batching by rule or by a measure the trial renews (see TRIAL_ROUNDS),
        starting one on a new request's decision if one is due; else None."""
        engines, busy = self.policy.engines_by_method, live.active_requests + live.waiting_requests > 0
        if not busy:
            self._trial = None  # alone: the idle rules and their exploration
            return None
        if (view is None or plan.method != "none" or plan.reason != "concurrency"
                or features.forced_depth is not None or self.policy.concurrency_threshold is not None):
            return None
        trial = self._trial
        if trial is not None:
            trial.decisions_left -= 1
            if trial.decisions_left <= 0:
                self._trial = trial = None
        context = max(features.prompt_tokens, live.context_tokens)
        batch = live.active_requests + live.waiting_requests + 1
        if trial is None and start:
            arms = {m: m in acceptance and view.batched_round(m, 1, batch, context) is not None
                    for m in engines if m != "none" and m in self.timed
                    and (self.policy.batching is None or m in self.policy.batching)
                    and (not features.has_penalties or capable_of(self.policy, m))
                    and _batch_may_win(view, acceptance.get(m), m, batch, context)}  # fmt: skip
            if arms and (arm := self._batch_explorers[features.content].choose("none", {"none": True, **arms})):
                self._trial = trial = _Trial(Plan(engines[arm], arm, 1, "concurrency", "explore"))
                log.info("%s: a batch trial of %s at depth 1 (%d requests in flight)", self.model_id,
                         arm, batch)  # fmt: skip
        if trial is None:
            return None
        method = trial.plan.method
        if features.has_penalties and not capable_of(self.policy, method):
            return None
        if not _batch_may_win(view, acceptance.get(method), method, batch, context):
            self._trial = None  # the batch grew past what it could win at
            return None
        if incumbent is not None and incumbent != method and features.max_tokens is not None:
            left = features.prompt_tokens + features.max_tokens - live.context_tokens
            if left < TRIAL_MIN_LEFT:
                return None
        return trial.plan

    def _explore(self, plan: Plan, features: RequestFeatures, live: LiveState,
                 view: CostView | None, acceptance) -> Plan | None:  # fmt: skip
        """The plan an idle request explores instead of `plan`, if any."""
        engines = self.policy.engines_by_method
        idle = live.active_requests + live.waiting_requests == 0
        if (view is None or not idle or plan.reason not in ("spec_on", "measured_loss")
                or features.forced_depth is not None or "none" not in engines):
            return None
        context, capable = features.prompt_tokens, self.policy.penalty_capable
        arms = {m: self._measured(m, view, acceptance, context) for m in engines
                if m in self.timed and (m == "none" or not features.has_penalties
                                        or capable is None or m in capable)}  # fmt: skip
        if plan.method not in arms:
            return None
        arm = self._explorers[features.content].choose(plan.method, arms)
        if arm is None:
            return None
        if arm == "none":
            return Plan(engines["none"], "none", 0, plan.reason, "explore")
        known = [c for c in candidates(self.policy, [arm], features, live, view, acceptance)
                 if c.method == arm]  # fmt: skip
        depth = max(known, key=lambda c: c.speed).depth if known else self.policy.depth(arm)
        return Plan(engines[arm], arm, depth, plan.reason, "explore")

    def _measured(self, method: Method, view: CostView, acceptance, context: int) -> bool:
        if method == "none":
            return view.plain(1, context) is not None
        return method in acceptance and view.round(method, self.policy.depth(method), context) is not None

    def plain_token_seconds(self, context: int, realised: float | None = None) -> float | None:
        """What one plain token costs a lone request at this context: as
        planners timed idle plain rounds (fed `realised` seconds per token),
        else the engines' timed steps, else None."""
        with self._lock:
            if realised is not None:
                self.realised_plain.observe(RoundStats(self.model_id, "none", 0, seconds=realised,
                                                       context_tokens=context))  # fmt: skip
            if (e := self.realised_plain.get("none", 1, context_bucket(context))) is not None:
                return e.mean
            view = self.view()
            estimate = view.plain(1, context) if view is not None else None
            return estimate.seconds if estimate is not None else None

    def guarded(self) -> Plan:
        """A request whose own rounds lost (policies/request_guard.py) decodes plainly."""
        return Plan(self.policy.engines_by_method["none"], "none", 0, "request_loss", "live")

    def next_round(self, features: RequestFeatures, live: LiveState, incumbent: Method) -> Plan:
        with self._lock:
            view = self.view(features.constrained)
            acceptance = self.acceptance.rates(self.model_id, features.content)
            plan = decide(self.policy, features, live, view, acceptance, incumbent)
            return self._batch_trial(plan, features, live, view, acceptance, incumbent=incumbent) or plan


@dataclass
class RequestPlanner:
    """One request's planner: asked at every round boundary, so a stream
    moves between speculation and batching as other requests come and go,
    and as its context grows. An exploring request keeps its explored plan
    for `hold` rounds while the model stays idle. The model-wide state
    counts, less this request itself. Its `guard` (policies/request_guard.py)
    judges the time between calls, alone on the model, against plain
    decoding's, and overrides every other rule while it holds the request
    to plain decoding (a forced method's request has a FixedPlanner; a
    forced depth alone is the depth of its speculative rounds, not a
    promise to speculate)."""

    policy: LivePolicy
    features: RequestFeatures
    current: Plan
    hold: int = 0
    guard: RequestGuard | None = None
    clock: Callable[[], float] = time.perf_counter
    _previous: Plan | None = None  # the plan before `current`: a switch's cost is in current's time
    _mark: tuple[float, int, bool] | None = None  # (clock, context, alone) at the last call

    def plan(self, state: LiveState) -> Plan:
        live = self.policy.live_state()
        others = LiveState(max(0, live.active_requests - 1), live.waiting_requests,
                           state.context_tokens)  # fmt: skip
        alone = others.active_requests + others.waiting_requests == 0
        self._account(state.context_tokens, alone)
        self._previous = self.current
        if self.guard is not None and self.guard.blocks():
            self.hold = 0  # an exploration that lost ends here
            self.current = self.policy.guarded()
            return self.current
        if self.hold > 0 and alone:
            self.hold -= 1
            return self.current
        self.hold = 0
        plan = self.policy.next_round(self.features, others, self.current.method)
        self.current = plan
        return plan

    def _account(self, context: int, alone: bool) -> None:
        """The interval since the last call ran `current` (after switching
        from `_previous`): its seconds and tokens, counted where the request
        was alone at both ends (a batch's steps are not a lone plain step's)."""
        now = self.clock()
        mark, self._mark = self._mark, (now, context, alone)
        if mark is None or not (alone and mark[2]):
            return
        seconds, tokens = now - mark[0], max(0, context - mark[1])
        plan, before = self.current, self._previous
        switched = before is not None and before.engine != plan.engine
        # A switch back to plain decoding is what speculating cost, too.
        speculative = plan.method != "none" or (switched and before.method != "none")
        realised = seconds / tokens if tokens and not speculative and not switched else None
        plain = self.policy.plain_token_seconds(context, realised)
        if self.guard is None or plain is None:
            return
        if (loss := self.guard.record(speculative, seconds, tokens, plain)) is not None:
            lost = plan if plan.method != "none" else before
            log.info("%s: %s (%s at depth %d); plain decoding for %d rounds", self.policy.model_id,
                     loss, lost.method, lost.depth, self.guard.backoff_left)  # fmt: skip
