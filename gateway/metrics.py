"""Prometheus metrics (prefix specgate_, vLLM's names where they exist).

One registry per app, so several gateways in one process (tests) never share
counters. Gauges of running/waiting requests are read from the engines at
scrape time rather than kept in step by hand.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engines.base import Plan, RoundStats
from gateway.models import ModelRegistry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _LiveCollector:
    def __init__(self, models: ModelRegistry):
        self.models = models

    def collect(self):
        running = GaugeMetricFamily(
            "specgate_num_requests_running", "Requests decoding now", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "specgate_num_requests_waiting", "Requests admitted, not yet decoding", labels=["model"]
        )
        for served in self.models.models.values():
            if served.engines:
                state = served.live_state()
                running.add_metric([served.id], state.active_requests)
                waiting.add_metric([served.id], state.waiting_requests)
        yield running
        yield waiting


class Metrics:
    def __init__(self, models: ModelRegistry):
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
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "specgate_e2e_request_latency_seconds", "Request latency", ["model", "method"],
            buckets=_LATENCY_BUCKETS, registry=r,
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
        r.register(_LiveCollector(models))

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

    def planned(self, model: str, plan: Plan) -> None:
        self.plan_decisions.labels(model, plan.method, plan.reason).inc()

    def finished(
        self, model: str, plan: Plan, status: str, prompt_tokens: int, generated: int,
        ttft: float | None, seconds: float,
    ) -> None:
        self.requests.labels(model, plan.method, status).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model, plan.method).inc(generated)
        if ttft is not None:
            self.ttft.labels(model, plan.method).observe(ttft)
        self.e2e.labels(model, plan.method).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
