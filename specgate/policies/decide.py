"""The decision: which plan serves a request, and why.

Pure code: no MLX, no HTTP. policies/model_policy.py calls `decide` when a
request arrives and again at every round boundary of its stream.

In order: a request's forced method or depth; no drafter; a model below the
size where speculation pays; penalties a drafter cannot apply per position;
a context (the stream's length now, not only its prompt's) past the
configured threshold; speculative engines still proving their verify
kernels (`kernels_proving`, when none is left). Then, with round costs (policies/live_costs.py: live
estimates, or `specgate tune`'s prior) and live acceptance, every candidate
plan's expected aggregate tokens/s is compared and the best one wins; its
reason says why plain decoding won when it did (`concurrency`: batching
beats the best speculation; `long_context`: speculation would win at short
context; `measured_loss`: it loses anyway), its source whether the numbers
were live or the prior's. A stream on an engine leaves it only where its
tokens left pay for the handoff (`near_end` when plain decoding stays).
With nothing to compare yet, the rule is simple: speculate when the model
is idle, batch when it is not (exploration, in policies/explore.py, makes
sure something gets measured).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from specgate.engines import registry
from specgate.engines.base import LiveState, Method, Plan, Source
from specgate.policies.content import ContentClass
from specgate.policies.costs import CostModel, expected_tokens
from specgate.policies.live_costs import CostView, prior_view


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
    long_context_tokens: int | None = None  # beyond this context (prompt + output): plain
    min_params: int | None = None  # speculation only for models at least this big
    params: int | None = None  # this model's parameter count
    auto_depth: bool = True  # the cost model may pick any depth up to the method's
    concurrency_threshold: int | None = None  # requests in flight that mean batching
    allow_overrides: bool = True
    # The methods whose engines prove their verify kernels now, asked at every
    # decision (engines/registry.proving); None: none ever do.
    proving: Callable[[], Collection[Method]] | None = None
    # The speculative methods whose engines verify several requests' drafts
    # in one batch (issue 45); the others run concurrent requests one after
    # another, so a batched round's cost means nothing for them (Gemma-4's
    # rotating windows, a quantized KV cache). None: every method batches.
    batching: frozenset[Method] | None = None
    # The most streams a method's engine speculates in one batch (its
    # MAX_BATCH); more wait their turn there. Absent: no limit.
    batch_caps: dict[Method, int] = field(default_factory=dict)

    def depth(self, method: Method) -> int:
        return self.depths.get(method, self.max_depth)


@dataclass(frozen=True)
class RequestFeatures:
    prompt_tokens: int
    has_penalties: bool
    forced_method: Method | None = None
    forced_depth: int | None = None
    content: ContentClass = "prose"  # whose acceptance rates the caller plans with
    constrained: bool = False  # held to a grammar: whose round costs it plans with
    max_tokens: int | None = None  # the most it may decode: what a switch has left to win back


@dataclass(frozen=True)
class Candidate:
    method: Method
    depth: int
    speed: float  # expected aggregate tokens/s
    source: Source  # where its round cost came from: "live" or "tune"


# A stream already on one engine moves to another only for a plan predicted
# this much faster: a handoff is not free, and estimates are noisy. A new
# request's default is plain decoding, and speculation needs the same
# margin over it: CostView.round's floor makes a round timed while the
# machine was quiet cost a plain step timed since it got busy, and a head
# accepted a few times in a hundred would then win on noise.
SWITCH_MARGIN = 0.1

# What a handoff costs, in tokens of the engine it leaves: the caches are
# evaluated and moved, and the receiving engine's first round is cold (a
# drafter has no hidden state or history of the sequence yet, a batch
# makes room). A stream switches only where the tokens it has left, at
# the predicted gain, win this back: near its end it stays where it is
# (a burst's last stream, alone for its last tokens, once moved to a
# speculative engine and lost what it moved for).
SWITCH_TOKENS = 4.0


def candidates(policy: ModelPolicy, methods: Sequence[Method], request: RequestFeatures,
               live: LiveState, costs: CostView | CostModel,
               acceptance: Mapping[Method, Sequence[float]]) -> list[Candidate]:
    """Plain decoding (batched with whatever is in flight) and every measured
    speculative method at every depth it allows, those whose costs are known,
    each at the model's aggregate tokens/s.
    A lone speculative round's is its own while nothing else is in flight.
    Beside others, it takes turns on the model with their plain batch (the
    engines share its lock): one round of this sequence, then one step of
    the others. Priced as this sequence's speed alone against the batch's
    aggregate, a lone round won at a few streams where the model lost: with
    an H100's costs through the kernels (a plain step of 1 stream ~4.6 ms,
    of 2 ~4.8 ms, a lone depth-4 MTP round ~5.9 ms for 3.4 tokens), one
    stream of two "won" at 0.57 tokens/ms against batching's 0.42, while
    the two together ran at 0.41.
    Where rounds of this many sequences speculating together were measured
    (a speculative engine's batch, issue 45), that plan's speed is the
    batch's aggregate."""
    view = prior_view(costs) if isinstance(costs, CostModel) else costs
    context = max(request.prompt_tokens, live.context_tokens)
    batch = live.active_requests + live.waiting_requests + 1
    out = []
    if (plain := view.plain(batch, context)) is not None:
        out.append(Candidate("none", 0, batch / plain.seconds, plain.source))
    # The others' plain step, which a lone round alternates with (none alone).
    others = view.plain(batch - 1, context) if batch > 1 else None
    for method in methods:
        if method not in acceptance:
            continue
        cap = policy.caps.get(method, policy.depth(method))
        if view.prior is not None:
            cap = min(cap, view.prior.max_width() - 1)
        depths = ([request.forced_depth] if request.forced_depth is not None
                  else [policy.depth(method)] if method in policy.fixed_depth or not policy.auto_depth
                  else range(1, cap + 1))  # fmt: skip
        for depth in depths:
            speeds = []
            if (cost := view.round(method, depth, context)) is not None:
                tokens = expected_tokens(acceptance[method], depth)
                if others is not None:
                    speeds.append(((tokens + batch - 1) / (cost.seconds + others.seconds), cost.source))
                else:
                    speeds.append((tokens / cost.seconds, cost.source))
            batches = policy.batching is None or method in policy.batching
            # Past the engine's batch the rest wait: the aggregate is its batch's.
            together = min(batch, policy.batch_caps.get(method, batch))
            if together > 1 and batches and (
                    cost := view.batched_round(method, depth, together, context)) is not None:  # fmt: skip
                tokens = together * expected_tokens(acceptance[method], depth)
                speeds.append((tokens / cost.seconds, cost.source))
            if speeds:
                speed, source = max(speeds)
                out.append(Candidate(method, depth, speed, source))
    return out


def decide(
    policy: ModelPolicy,
    request: RequestFeatures,
    live: LiveState,
    costs: CostView | CostModel | None = None,
    acceptance: Mapping[Method, Sequence[float]] | None = None,
    incumbent: Method | None = None,
) -> Plan:
    """Choose the plan for a request, or for the next round of a stream on
    `incumbent`'s engine (raises OverrideError on a bad override); a plan
    other than the incumbent's, or for a new request than plain decoding,
    must be predicted SWITCH_MARGIN faster.
    `live.context_tokens` is the stream's length now, which the long-context
    rule and the costs read as well as the prompt's."""
    available = policy.engines_by_method
    speculative = [m for m in available if m != "none"]
    context = max(request.prompt_tokens, live.context_tokens)
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

    def plain(reason, source="rule") -> Plan:
        return Plan(available["none"], "none", 0, reason, source)

    if policy.min_params and policy.params is not None and policy.params < policy.min_params:
        return plain("small_model")
    if request.has_penalties and policy.penalty_capable is not None:
        speculative = [m for m in speculative if m in policy.penalty_capable]
        if not speculative:
            return plain("penalties")
    if policy.long_context_tokens is not None and context > policy.long_context_tokens:
        return plain("long_context")
    if policy.proving is not None and (proving := policy.proving()):
        # Kernels proved in the background (engines/mlx_spec/kernel_proofs.py):
        # until the switch such an engine verifies on the stock path, which on
        # a GPU loses to plain decoding. Asked again at the next round.
        speculative = [m for m in speculative if m not in proving]
        if not speculative:
            return plain("kernels_proving")
    in_flight = live.active_requests + live.waiting_requests
    if policy.concurrency_threshold is not None:
        # A configured threshold is the whole concurrency rule.
        if in_flight + 1 >= policy.concurrency_threshold:
            return plain("concurrency")
        live = LiveState(0, 0, live.context_tokens)
    busy = live.active_requests + live.waiting_requests > 0
    measured = [m for m in speculative if acceptance and m in acceptance]
    if isinstance(costs, CostModel):  # a prior alone: wrapped once, not per candidates() call
        costs = prior_view(costs)
    options = candidates(policy, measured, request, live, costs, acceptance) if costs and measured else []
    if not any(c.method == "none" for c in options) or all(c.method == "none" for c in options):
        # Nothing to compare yet: speculation serves one sequence, batching the rest.
        if busy:
            return plain("concurrency")
        method = speculative[0]
        return Plan(available[method], method, _depth(policy, method, request), "spec_on")

    default = incumbent if incumbent is not None else "none"

    def score(c: Candidate) -> float:
        return c.speed * (1 + SWITCH_MARGIN if c.method == default else 1)

    best = max(options, key=score)  # the first (plain) on a tie
    source = "tune" if any(c.source == "tune" for c in options) else "live"
    if incumbent is not None and best.method != incumbent and not _worth_switching(
            best, options, incumbent, request, context):  # fmt: skip
        if incumbent == "none":
            return plain("near_end", source)
        stay = max((c for c in options if c.method == incumbent), key=lambda c: c.speed)
        return Plan(available[incumbent], incumbent, stay.depth, "spec_on", source)
    if best.method != "none":
        return Plan(available[best.method], best.method, best.depth, "spec_on", source)
    # Why plain decoding won: would speculation win, by the same rule, alone
    # (then it is the concurrency) or at a short context?
    alone = max((score(c) for c in options if c.method != "none"), default=0.0)
    if busy:
        single = candidates(policy, [], request, LiveState(0, 0, live.context_tokens), costs, {})
        if not single or alone > score(single[0]):
            return plain("concurrency", source)
    short = RequestFeatures(0, request.has_penalties, None, request.forced_depth)
    idle = LiveState(0, 0, 0)
    at_short = candidates(policy, measured, short, idle, costs, acceptance)
    plain_short = next((score(c) for c in at_short if c.method == "none"), None)
    if context > 0 and plain_short and any(score(c) > plain_short for c in at_short if c.method != "none"):
        return plain("long_context", source)
    return plain("measured_loss", source)


def _worth_switching(best: Candidate, options: Sequence[Candidate], incumbent: Method,
                     request: RequestFeatures, context: int) -> bool:  # fmt: skip
    """Whether moving from `incumbent`'s engine to `best`'s saves more, over
    the tokens the request has left, than the handoff costs (SWITCH_TOKENS);
    unknown (no bound, or the incumbent's speed not estimated): yes."""
    stay = [c.speed for c in options if c.method == incumbent]
    if request.max_tokens is None or not stay or best.speed <= 0:
        return True
    left = request.prompt_tokens + request.max_tokens - context
    # In the incumbent's tokens: each left costs 1 there, max(stay)/best here.
    return left * (1 - max(stay) / best.speed) >= SWITCH_TOKENS


def _depth(policy: ModelPolicy, method: Method, request: RequestFeatures) -> int:
    return policy.depth(method) if request.forced_depth is None else request.forced_depth


def _forced(policy: ModelPolicy, request: RequestFeatures) -> Plan:
    available = policy.engines_by_method
    method = request.forced_method
    if method not in registry.methods():
        raise OverrideError(f"unknown method '{method}'; methods are "
                            f"{', '.join(registry.methods())}")  # fmt: skip
    # "ngram" on a model served by llama-server is its llamacpp_ngram.
    method = registry.resolve_method(method, [*available, *policy.refused])
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
