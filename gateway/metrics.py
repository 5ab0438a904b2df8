"""Prometheus metrics (prefix specgate_, vLLM's names where they exist).

One registry per app, so several gateways in one process (tests) never share
counters. Gauges (running/waiting requests, acceptance) are computed at scrape
time rather than kept in step by hand. Labels are bounded: model, method,
reason, status, position. deploy/grafana/ ships a dashboard over these names.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from engines.base import Plan, RoundStats
from gateway.models import ModelRegistry

# No *_created series: one per labelled counter/histogram, and nothing reads them.
disable_created_metrics()

# Local inference: a tiny model answers in milliseconds, a long prompt on a
# big one takes a minute to prefill, a long generation minutes.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                  0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60,
                90, 120, 180, 300, 450, 600)


class Metrics:
    def __init__(self, models: ModelRegistry):
        self.models = models
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "specgate_requests", "Finished requests", ["model", "method", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "specgate_prompt_tokens", "Prompt tokens processed", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "specgate_generation_tokens", "Tokens generated", ["model", "method"], registry=r
        )
        self.plan_decisions = Counter(
            "specgate_plan_decisions", "Plans chosen", ["model", "method", "reason"], registry=r
        )
        self.ttft = Histogram(
            "specgate_time_to_first_token_seconds", "Time to first token", ["model", "method"],
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "specgate_inter_token_latency_seconds",
            "Time between output tokens after the first (a round's tokens share its gap)",
            ["model", "method"], buckets=_TOKEN_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "specgate_e2e_request_latency_seconds", "Request latency", ["model", "method"],
            buckets=_E2E_BUCKETS, registry=r,
        )
        # vLLM's spec-decode schema, labelled by model and method.
        self.drafts = Counter(
            "specgate_spec_decode_num_drafts", "Speculative rounds that drafted",
            ["model", "method"], registry=r,
        )
        self.draft_tokens = Counter(
            "specgate_spec_decode_num_draft_tokens", "Draft tokens proposed",
            ["model", "method"], registry=r,
        )
        self.accepted_tokens = Counter(
            "specgate_spec_decode_num_accepted_tokens", "Draft tokens accepted",
            ["model", "method"], registry=r,
        )
        self.accepted_per_pos = Counter(
            "specgate_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted by position",
            ["model", "method", "position"], registry=r,
        )
        # (model, method) -> [drafts, draft tokens, accepted], for the ratio gauges.
        self._spec: dict[tuple[str, str], list[int]] = {}
        r.register(self)  # collect() below: the scrape-time gauges

    def round(self, stats: RoundStats) -> None:
        if stats.drafted == 0:
            return
        labels = (stats.model, stats.method)
        self.drafts.labels(*labels).inc()
        self.draft_tokens.labels(*labels).inc(stats.drafted)
        self.accepted_tokens.labels(*labels).inc(stats.accepted)
        for pos, ok in enumerate(stats.accepted_per_position):
            if ok:
                self.accepted_per_pos.labels(*labels, str(pos)).inc()
        totals = self._spec.setdefault(labels, [0, 0, 0])
        totals[0] += 1
        totals[1] += stats.drafted
        totals[2] += stats.accepted

    def planned(self, model: str, plan: Plan) -> None:
        self.plan_decisions.labels(model, plan.method, plan.reason).inc()

    def tokens(self, model: str, method: str, count: int, gap: float | None) -> None:
        """`count` output tokens arrived from `method`, `gap` seconds after the
        previous ones (None for the first): each is observed at gap / count,
        the per-token time a client sees. Counted as they come, by the method
        that made them, so a stream that changes method is split truthfully."""
        if count <= 0:
            return
        self.generation_tokens.labels(model, method).inc(count)
        if gap is not None:
            child = self.itl.labels(model, method)
            for _ in range(count):
                child.observe(gap / count)

    def finished(
        self, model: str, plan: Plan, status: str, prompt_tokens: int,
        ttft: float | None, seconds: float,
    ) -> None:
        self.requests.labels(model, plan.method, status).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        if ttft is not None:
            self.ttft.labels(model, plan.method).observe(ttft)
        self.e2e.labels(model, plan.method).observe(seconds)

    def collect(self):
        running = GaugeMetricFamily(
            "specgate_num_requests_running", "Requests decoding now", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "specgate_num_requests_waiting", "Requests admitted, not yet decoding", labels=["model"]
        )
        policy = GaugeMetricFamily(
            "specgate_policy_acceptance_rate",
            "Live conditional acceptance per draft position the policy plans with (EWMA)",
            labels=["model", "method", "position"],
        )
        for served in self.models.models.values():
            if served.engines:
                state = served.live_state()
                running.add_metric([served.id], state.active_requests)
                waiting.add_metric([served.id], state.waiting_requests)
                for method, rates in served.acceptance.rates(served.id).items():
                    for pos, rate in enumerate(rates):
                        policy.add_metric([served.id, method, str(pos)], rate)
        rate = GaugeMetricFamily(
            "specgate_spec_decode_acceptance_rate",
            "Draft tokens accepted / proposed since start", labels=["model", "method"],
        )
        length = GaugeMetricFamily(
            "specgate_spec_decode_mean_acceptance_length",
            "Tokens per speculative round since start (1 + accepted / drafts)",
            labels=["model", "method"],
        )
        for (model, method), (drafts, drafted, accepted) in list(self._spec.items()):
            rate.add_metric([model, method], accepted / drafted)
            length.add_metric([model, method], 1 + accepted / drafts)
        yield from (running, waiting, policy, rate, length)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
