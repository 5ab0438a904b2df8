"""The decision: which plan serves a request, and why.

Pure code: no MLX, no HTTP. The gateway calls `decide` once per request and
hands the engine a planner that asks again at every round boundary.

In order: a request's forced method or depth; no drafter; a model below the
size where speculation pays; penalties a drafter cannot apply per position;
a context past the configured threshold. Then, with measured costs
(policies/costs.py) and live acceptance, every candidate plan's expected
aggregate tokens/s is compared and the best one wins; its reason says why
plain decoding won when it did (`concurrency`: batching beats the best
speculation; `long_context`: speculation would win at short context;
`measured_loss`: it loses anyway). Without measurements yet, the rule is
simple: speculate when the model is idle, batch when it is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engines.base import METHODS, LiveState, Method, Plan
from policies.content import ContentClass
from policies.costs import CostModel, speculative_speed


class OverrideError(ValueError):
    """A request asked for a method or depth this model cannot serve."""


@dataclass(frozen=True)
class ModelPolicy:
    """What the model's config allows: method -> engine that serves it, in
    preference order (speculative methods first, "none" last when present)."""

    model_id: str
    engines_by_method: dict[Method, str]
    max_depth: int = 0
    refused: dict[Method, str] = field(default_factory=dict)  # configured, not servable: why
    # Methods whose depth is fixed when the engine starts (llama-server's
    # --spec-draft-n-max), so a request cannot change it.
    fixed_depth: tuple[Method, ...] = ()
    depths: dict[Method, int] = field(default_factory=dict)  # per method, else max_depth
    caps: dict[Method, int] = field(default_factory=dict)  # the most a drafter can draft
    # Methods whose drafter applies sampling penalties per draft position, so
    # a request with penalties keeps its distribution (None: every method).
    penalty_capable: frozenset[Method] | None = None
    long_context_tokens: int | None = None  # beyond this prompt length: plain decoding
    min_params: int | None = None  # speculation only for models at least this big
    params: int | None = None  # this model's parameter count
    auto_depth: bool = True  # the cost model may pick any depth up to the method's
    concurrency_threshold: int | None = None  # requests in flight that mean batching
    allow_overrides: bool = True

    def depth(self, method: Method) -> int:
        return self.depths.get(method, self.max_depth)


@dataclass(frozen=True)
class RequestFeatures:
    prompt_tokens: int
    has_penalties: bool
    forced_method: Method | None = None
    forced_depth: int | None = None
    content: ContentClass = "prose"  # whose acceptance rates the caller plans with


@dataclass(frozen=True)
class Candidate:
    method: Method
    depth: int
    speed: float  # expected aggregate tokens/s relative to one plain sequence


def candidates(policy: ModelPolicy, methods: Sequence[Method], request: RequestFeatures,
               live: LiveState, costs: CostModel,
               acceptance: Mapping[Method, Sequence[float]]) -> list[Candidate]:
    """Plain decoding (batched with whatever is in flight) and every measured
    speculative method at every depth it allows. Speculation decodes one
    sequence at a time, so its speed is that sequence's."""
    others = live.active_requests + live.waiting_requests
    out = [Candidate("none", 0, costs.batched_gain(others + 1))]
    for method in methods:
        if method not in acceptance:
            continue
        cap = min(policy.caps.get(method, policy.depth(method)), costs.max_width() - 1)
        depths = ([request.forced_depth] if request.forced_depth is not None
                  else [policy.depth(method)] if method in policy.fixed_depth or not policy.auto_depth
                  else range(1, cap + 1))  # fmt: skip
        for depth in depths:
            speed = speculative_speed(costs, method, acceptance[method], depth, request.prompt_tokens)
            out.append(Candidate(method, depth, speed))
    return out


def decide(
    policy: ModelPolicy,
    request: RequestFeatures,
    live: LiveState,
    costs: CostModel | None = None,
    acceptance: Mapping[Method, Sequence[float]] | None = None,
) -> Plan:
    """Choose the plan for a request (raises OverrideError on a bad override)."""
    available = policy.engines_by_method
    speculative = [m for m in available if m != "none"]
    if not policy.allow_overrides and (request.forced_method or request.forced_depth is not None):
        raise OverrideError(f"model '{policy.model_id}' does not let requests choose the method "
                            "or depth (policy.allow_overrides: false)")
    if request.forced_method is not None:
        return _forced(policy, request)
    if not speculative:
        if request.forced_depth is not None:
            raise OverrideError(
                f"X-Specgate-Depth needs a speculative method; model '{policy.model_id}' "
                f"serves only: {', '.join(available)}"
            )
        return Plan(available["none"], "none", 0, "no_drafter")
    if request.forced_depth is not None:
        # A forced depth narrows the choice to the methods that can draft it.
        fits = [m for m in speculative if _depth_error(policy, m, request.forced_depth) is None]
        if not fits:
            _check_depth(policy, speculative[0], request.forced_depth)
        speculative = fits
    if "none" not in available:  # nothing else can serve it
        method = speculative[0]
        return Plan(available[method], method, _depth(policy, method, request), "spec_on")

    def plain(reason) -> Plan:
        return Plan(available["none"], "none", 0, reason)

    if policy.min_params and policy.params is not None and policy.params < policy.min_params:
        return plain("small_model")
    if request.has_penalties and policy.penalty_capable is not None:
        speculative = [m for m in speculative if m in policy.penalty_capable]
        if not speculative:
            return plain("penalties")
    if policy.long_context_tokens is not None and request.prompt_tokens > policy.long_context_tokens:
        return plain("long_context")
    in_flight = live.active_requests + live.waiting_requests
    if policy.concurrency_threshold is not None:
        # A configured threshold is the whole concurrency rule.
        if in_flight + 1 >= policy.concurrency_threshold:
            return plain("concurrency")
        live = LiveState(0, 0, live.context_tokens)
    busy = live.active_requests + live.waiting_requests > 0
    measured = [m for m in speculative if acceptance and m in acceptance]
    if costs is None or not measured:
        # Unmeasured: speculation serves one sequence, batching the rest.
        if busy:
            return plain("concurrency")
        method = speculative[0]
        return Plan(available[method], method, _depth(policy, method, request), "spec_on")

    options = candidates(policy, measured, request, live, costs, acceptance)
    best = max(options, key=lambda c: c.speed)  # the first (plain) on a tie
    if best.method != "none":
        return Plan(available[best.method], best.method, best.depth, "spec_on")
    alone = max((c.speed for c in options if c.method != "none"), default=0.0)
    if busy and alone > 1.0:
        return plain("concurrency")
    short = RequestFeatures(0, request.has_penalties, None, request.forced_depth)
    idle = LiveState(0, 0, 0)
    if any(c.speed > 1.0 for c in candidates(policy, measured, short, idle, costs, acceptance)):
        return plain("long_context")
    return plain("measured_loss")


def _depth(policy: ModelPolicy, method: Method, request: RequestFeatures) -> int:
    return policy.depth(method) if request.forced_depth is None else request.forced_depth


def _forced(policy: ModelPolicy, request: RequestFeatures) -> Plan:
    available = policy.engines_by_method
    method = request.forced_method
    if method not in METHODS:
        raise OverrideError(f"unknown method '{method}'; methods are {', '.join(METHODS)}")
    if method in policy.refused:
        raise OverrideError(
            f"method '{method}' is refused for model '{policy.model_id}': "
            f"{policy.refused[method]}"
        )
    if method not in available:
        raise OverrideError(
            f"method '{method}' is not available for model '{policy.model_id}'; "
            f"available: {', '.join(available)}"
        )
    _check_depth(policy, method, request.forced_depth)
    depth = 0 if method == "none" else _depth(policy, method, request)
    return Plan(available[method], method, depth, "forced_by_request")


def _depth_error(policy: ModelPolicy, method: Method, forced: int | None) -> str | None:
    if forced is not None and forced > policy.caps.get(method, forced):
        return (f"X-Specgate-Depth: method '{method}' of model '{policy.model_id}' drafts at "
                f"most {policy.caps[method]} tokens per round")
    if forced is not None and method in policy.fixed_depth and forced != policy.depth(method):
        return (f"X-Specgate-Depth: method '{method}' of model '{policy.model_id}' drafts "
                f"{policy.depth(method)} tokens per round, fixed when its server starts")
    return None


def _check_depth(policy: ModelPolicy, method: Method, forced: int | None) -> None:
    if (error := _depth_error(policy, method, forced)) is not None:
        raise OverrideError(error)


@dataclass(frozen=True)
class FixedPlanner:
    """A planner that keeps the request's first plan for every round."""

    plan_: Plan

    def plan(self, state: LiveState) -> Plan:
        return self.plan_
