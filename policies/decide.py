"""The decision: which plan serves a request, and why.

Pure code: no MLX, no HTTP. The gateway calls `decide` once per request and
hands the engine a planner that asks again at every round boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.base import METHODS, LiveState, Method, Plan


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

    def depth(self, method: Method) -> int:
        return self.depths.get(method, self.max_depth)


@dataclass(frozen=True)
class RequestFeatures:
    prompt_tokens: int
    has_penalties: bool
    forced_method: Method | None = None
    forced_depth: int | None = None


def decide(policy: ModelPolicy, request: RequestFeatures, live: LiveState) -> Plan:
    """Choose the plan for a request (raises OverrideError on a bad override)."""
    available = policy.engines_by_method
    speculative = [m for m in available if m != "none"]
    if request.forced_method is not None:
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
        depth = policy.depth(method) if request.forced_depth is None else request.forced_depth
        return Plan(available[method], method, 0 if method == "none" else depth, "forced_by_request")
    if not speculative:
        if request.forced_depth is not None:
            raise OverrideError(
                f"X-Specgate-Depth needs a speculative method; model '{policy.model_id}' "
                f"serves only: {', '.join(available)}"
            )
        return Plan(available["none"], "none", 0, "no_drafter")
    method = speculative[0]
    _check_depth(policy, method, request.forced_depth)
    # Speculation serves one sequence; anything already in flight means
    # concurrency, which batching serves better (when the model can batch).
    if "none" in available and (live.active_requests or live.waiting_requests):
        return Plan(available["none"], "none", 0, "concurrency")
    depth = policy.depth(method) if request.forced_depth is None else request.forced_depth
    return Plan(available[method], method, depth, "spec_on")


def _check_depth(policy: ModelPolicy, method: Method, forced: int | None) -> None:
    if forced is not None and forced > policy.caps.get(method, forced):
        raise OverrideError(
            f"X-Specgate-Depth: method '{method}' of model '{policy.model_id}' drafts at most "
            f"{policy.caps[method]} tokens per round"
        )
    if forced is not None and method in policy.fixed_depth and forced != policy.depth(method):
        raise OverrideError(
            f"X-Specgate-Depth: method '{method}' of model '{policy.model_id}' drafts "
            f"{policy.depth(method)} tokens per round, fixed when its server starts"
        )


@dataclass(frozen=True)
class FixedPlanner:
    """A planner that keeps the request's first plan for every round."""

    plan_: Plan

    def plan(self, state: LiveState) -> Plan:
        return self.plan_
