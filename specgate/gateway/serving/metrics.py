"""Prometheus metrics (prefix specgate_, vLLM's names where they exist).

One registry per app, so several gateways in one process (tests) never share
counters. Gauges (running/waiting requests, acceptance) are computed at scrape
time rather than kept in step by hand. Labels are bounded: model, method,
reason, status, position, node (a peer's configured name), and key: an API key's NAME from the keys file
(never the key; "anonymous" on an open server). deploy/grafana/ ships a
dashboard over these names.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from specgate.engines.base import Plan, RoundStats
from specgate.engines.cpu import POOL
from specgate.engines.grammar.sandbox import SANDBOX
from specgate.engines.memory import process_rss
from specgate.gateway.serving.models import STATES, ModelRegistry
from specgate.policies.content import CONTENT_CLASSES

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


@dataclass
class LiveRequest:
    """A request decoding now (the admin page lists them)."""

    model: str
    key: str
    method: str
    prompt_tokens: int
    started: float = field(default_factory=time.monotonic)
    generated: int = 0


class LiveRequests:
    def __init__(self):
        self.requests: dict[str, LiveRequest] = {}

    def begin(self, request_id: str, model: str, key: str, method: str, prompt: int) -> LiveRequest:
        self.requests[request_id] = live = LiveRequest(model, key, method, prompt)
        return live

    def end(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


class Metrics:
    def __init__(self, models: ModelRegistry):
        self.models = models
        self.live = LiveRequests()
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
        self.vector_inputs = Counter(
            "specgate_embedding_inputs",
            "Inputs embedded (kind embed) or documents scored (kind rerank)",
            ["model", "kind"], registry=r,
        )
        self.plan_decisions = Counter(
            "specgate_plan_decisions",
            "Plans chosen (at a request's start and at every switch), with why and where the "
            "numbers came from (source: rule, live, tune, explore)",
            ["model", "method", "reason", "source"], registry=r,
        )
        self.explorations = Counter(
            "specgate_policy_explorations",
            "Requests that tried a plan the policy's estimates did not favour, to keep them fresh",
            ["model", "method"], registry=r,
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
        # Beyond vLLM's schema: rounds planned with drafts whose proposer had
        # none to offer (a copy from the context that matched nothing).
        self.undrafted = Counter(
            "specgate_spec_decode_num_undrafted_rounds",
            "Speculative rounds planned with drafts that drafted none (nothing to copy)",
            ["model", "method"], registry=r,
        )
        # Rounds decoded inside a batch of `batch` sequences (issue 45; 1: alone),
        # each sequence's round counted: its drafts, what stood, and the rows
        # it verified (a batch's verify forward carries every sequence's).
        self.batch_rounds = Counter(
            "specgate_spec_decode_batch_rounds", "Speculative rounds by the decode batch they ran in",
            ["model", "method", "batch"], registry=r,
        )
        self.batch_draft_tokens = Counter(
            "specgate_spec_decode_batch_draft_tokens", "Draft tokens by decode batch size",
            ["model", "method", "batch"], registry=r,
        )
        self.batch_accepted_tokens = Counter(
            "specgate_spec_decode_batch_accepted_tokens", "Draft tokens accepted by decode batch size",
            ["model", "method", "batch"], registry=r,
        )
        self.batch_verify_rows = Counter(
            "specgate_spec_decode_batch_verify_rows", "Rows verified by decode batch size",
            ["model", "method", "batch"], registry=r,
        )
        # Per API key, by name.
        self.key_requests = Counter(
            "specgate_key_requests", "Finished requests by API key", ["key", "status"], registry=r
        )
        self.key_prompt = Counter(
            "specgate_key_prompt_tokens", "Prompt tokens by API key", ["key"], registry=r
        )
        self.key_generation = Counter(
            "specgate_key_generation_tokens", "Tokens generated by API key", ["key"], registry=r
        )
        self.key_rejected = Counter(
            "specgate_key_rejected_requests",
            "Requests refused before decoding, by API key and reason "
            "(rpm, tpm, concurrency, queue_full, queue_timeout)",
            ["key", "reason"], registry=r,
        )
        self.auth_failures = Counter(
            "specgate_auth_failures", "Requests refused for a missing or invalid API key",
            ["reason"], registry=r,
        )
        self.auth_rate_limited = Counter(
            "specgate_auth_rate_limited",
            "Requests answered 429 because their address sent too many wrong API keys",
            registry=r,
        )
        self.queue_time = Histogram(
            "specgate_request_queue_time_seconds", "Time waiting for a decoding slot",
            ["model"], buckets=_TTFT_BUCKETS, registry=r,
        )
        # Several nodes (gateway/cluster/peers.py): where requests went, by node
        # ("local": this one), and how the peers' ones ended.
        self.routed_requests = Counter(
            "specgate_routed_requests", "Requests routed, by the node chosen to serve them",
            ["node", "model"], registry=r,
        )
        self.peer_requests = Counter(
            "specgate_peer_requests",
            "Requests relayed to a peer, by outcome (ok, error: the peer's 4xx/5xx, failed: "
            "the peer broke off or sent what is not passed on, unreachable: tried the next node, "
            "cancelled: the client left)",
            ["node", "model", "outcome"], registry=r,
        )
        self.peer_latency = Histogram(
            "specgate_peer_request_seconds", "Relayed requests, from sending to the last byte",
            ["node", "model"], buckets=_E2E_BUCKETS, registry=r,
        )
        self.peers = None  # specgate.gateway.cluster.peers.Peers, when the node has some
        # specgate.gateway.access.connections.ConnectionLimits, set by the
        # server (gateway/server.py); None in an app served otherwise (tests).
        self.connections = None
        # (model, method) -> [drafts, draft tokens, accepted], for the ratio gauges.
        self._spec: dict[tuple[str, str], list[int]] = {}
        # process_* (CPU, resident memory, open files): read from /proc, so Linux only.
        ProcessCollector(registry=r)
        r.register(self)  # collect() below: the scrape-time gauges

    def round(self, stats: RoundStats) -> None:
        if stats.method != "none":
            by_batch = (stats.model, stats.method, str(stats.batch))
            self.batch_rounds.labels(*by_batch).inc()
            self.batch_draft_tokens.labels(*by_batch).inc(stats.drafted)
            self.batch_accepted_tokens.labels(*by_batch).inc(stats.accepted)
            self.batch_verify_rows.labels(*by_batch).inc(stats.verify_width)
        if stats.drafted == 0:
            if stats.asked > 0:
                self.undrafted.labels(stats.model, stats.method).inc()
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
        self.plan_decisions.labels(model, plan.method, plan.reason, plan.source).inc()
        if plan.source == "explore":
            self.explorations.labels(model, plan.method).inc()

    def tokens(
        self, model: str, method: str, count: int, gap: float | None, key: str = "anonymous"
    ) -> None:
        """`count` output tokens arrived from `method`, `gap` seconds after the
        previous ones (None for the first): each is observed at gap / count,
        the per-token time a client sees. Counted as they come, by the method
        that made them, so a stream that changes method is split truthfully."""
        if count <= 0:
            return
        self.generation_tokens.labels(model, method).inc(count)
        self.key_generation.labels(key).inc(count)
        if gap is not None:
            child = self.itl.labels(model, method)
            for _ in range(count):
                child.observe(gap / count)

    def finished(
        self, model: str, plan: Plan, status: str, prompt_tokens: int,
        ttft: float | None, seconds: float, key: str = "anonymous",
    ) -> None:
        self.requests.labels(model, plan.method, status).inc()
        self.key_requests.labels(key, status).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        if ttft is not None:
            self.ttft.labels(model, plan.method).observe(ttft)
        self.e2e.labels(model, plan.method).observe(seconds)

    def vectors_finished(self, model: str, kind: str, status: str, tokens: int, inputs: int,
                         seconds: float, key: str = "anonymous") -> None:  # fmt: skip
        """An embeddings (kind "embed") or rerank request's end: counted
        with the generations' requests, prompt tokens and latency, its
        method label the kind."""
        self.requests.labels(model, kind, status).inc()
        self.key_requests.labels(key, status).inc()
        self.prompt_tokens.labels(model).inc(tokens)
        self.e2e.labels(model, kind).observe(seconds)
        if status == "ok":
            self.vector_inputs.labels(model, kind).inc(inputs)

    def key_prompt_tokens(self, key: str, count: int) -> None:
        self.key_prompt.labels(key).inc(count)

    def rejected(self, key: str, reason: str) -> None:
        self.key_rejected.labels(key, reason).inc()

    def auth_failed(self, reason: str) -> None:
        """A refusal by gateway/access/auth.py's middleware. "rate_limited" (429) is
        counted apart: those are not more wrong keys, they are the limit
        holding an address back, and the two rates tell different stories."""
        if reason == "rate_limited":
            self.auth_rate_limited.inc()
        else:
            self.auth_failures.labels(reason).inc()

    def queued(self, model: str, seconds: float) -> None:
        self.queue_time.labels(model).observe(seconds)

    def routed(self, node: str, model: str) -> None:
        self.routed_requests.labels(node, model).inc()

    def proxied(self, node: str, model: str, outcome: str, seconds: float) -> None:
        self.peer_requests.labels(node, model, outcome).inc()
        if outcome != "unreachable":
            self.routed_requests.labels(node, model).inc()
            self.peer_latency.labels(node, model).observe(seconds)

    def _peers(self):
        up = GaugeMetricFamily("specgate_peer_up", "1 while the peer answers its checks",
                               labels=["node"])  # fmt: skip
        inflight = GaugeMetricFamily("specgate_peer_requests_in_flight",
                                     "Requests relayed to the peer now", labels=["node"])  # fmt: skip
        load = GaugeMetricFamily(
            "specgate_peer_load",
            "A peer's (running + waiting) / max_concurrent per model, as routing estimates it",
            labels=["node", "model"])  # fmt: skip
        for node in self.peers.nodes.values():
            up.add_metric([node.name], 1.0 if node.up else 0.0)
            inflight.add_metric([node.name], float(sum(node.inflight.values())))
            for model in node.models:
                load.add_metric([node.name, model], node.load(model))
        yield from (up, inflight, load)

    def collect(self):
        running = GaugeMetricFamily(
            "specgate_num_requests_running", "Requests decoding now", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "specgate_num_requests_waiting",
            "Requests waiting: in the admission queue, or admitted and not yet decoding",
            labels=["model"],
        )
        policy = GaugeMetricFamily(
            "specgate_policy_acceptance_rate",
            "Live conditional acceptance per draft position the policy plans with (EWMA)",
            labels=["model", "method", "content", "position"],
        )
        costs = GaugeMetricFamily(
            "specgate_policy_round_seconds",
            "Live estimate of one round's cost the policy plans with: a plain step of `width` "
            "sequences (method none) or a speculative round drafting `width` tokens, at contexts "
            "in `context` (bucket k >= 1: 2^(k-1) to 2^k thousand tokens; 0: below 1024)",
            labels=["model", "method", "width", "context"],
        )
        spread = GaugeMetricFamily(
            "specgate_policy_round_seconds_spread",
            "Relative standard deviation of those rounds: how noisy the estimate is",
            labels=["model", "method", "width", "context"],
        )
        for served in self.models.models.values():
            if served.engines and (live := served.policy) is not None:
                state = served.live_state()
                running.add_metric([served.id], state.active_requests)
                waiting.add_metric([served.id], state.waiting_requests + served.gate.waiting)
                for content in CONTENT_CLASSES:
                    for method, rates in live.acceptance.rates(served.id, content).items():
                        for pos, rate in enumerate(rates):
                            policy.add_metric([served.id, method, content, str(pos)], rate)
                for (method, width, bucket), e in live.costs.snapshot().items():
                    labels = [served.id, method, str(width), str(bucket)]
                    costs.add_metric(labels, e.mean)
                    spread.add_metric(labels, e.spread)
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
        yield from (running, waiting, policy, costs, spread, rate, length)
        yield from self._models()
        yield from self._prefix_caches()
        if self.peers:
            yield from self._peers()
        yield from self._connections()
        yield from self._request_cpu()

    def _models(self):
        """Residency (gateway/serving/models.py): state, memory, loads and unloads."""
        m = "model"
        state = GaugeMetricFamily("specgate_model_state",
                                  "1 for the state each model is in now", labels=[m, "state"])
        memory = GaugeMetricFamily(
            "specgate_model_memory_bytes",
            "Memory a model holds by kind: weights and drafter once loaded (llama-server: the "
            "GGUF's tensors), kv_reserve (llama-server: its processes' KV caches; else as "
            "budgeted); the kinds add up",
            labels=[m, "kind"])  # fmt: skip
        resident_of = GaugeMetricFamily(
            "specgate_model_resident_memory_bytes",
            "A model's child processes' resident size as measured (llama-server: weights pages "
            "touched, KV, buffers; the same memory specgate_model_memory_bytes counts)",
            labels=[m])  # fmt: skip
        loads = CounterMetricFamily("specgate_model_loads", "Model loads, by result",
                                    labels=[m, "result"])
        unloads = CounterMetricFamily("specgate_model_unloads",
                                      "Model unloads, by reason (idle, evicted, admin, reload)",
                                      labels=[m, "reason"])
        load_time = SummaryMetricFamily("specgate_model_load_seconds",
                                        "Time to load a model (successful loads)", labels=[m])
        failing = GaugeMetricFamily("specgate_model_failed_loads_in_a_row",
                                    "Failed loads since the model's last successful one (each "
                                    "doubles the wait before it is tried again; the reason is in "
                                    "/v1/models and /admin/status)", labels=[m])  # fmt: skip
        budget = GaugeMetricFamily("specgate_memory_budget_bytes",
                                   "server.memory_budget, and its parts: the prefix cache's RAM "
                                   "and what models may use",
                                   labels=["scope"])  # fmt: skip
        budget.add_metric(["server"], self.models.memory_budget)
        budget.add_metric(["models"], self.models.models_budget)
        budget.add_metric(["prefix_cache"], self.models.prefix_cache_budget)
        for served in self.models.models.values():
            now = served.state
            for name in STATES:
                state.add_metric([served.id, name], float(name == now))
            for kind, n in served.memory().items():
                memory.add_metric([served.id, kind], n)
            if (rss := served.resident()) is not None:
                resident_of.add_metric([served.id], rss)
            c = served.counts
            loads.add_metric([served.id, "ok"], c.loads)
            loads.add_metric([served.id, "failed"], c.load_failures)
            for reason in ("idle", "evicted", "admin", "reload"):
                unloads.add_metric([served.id, reason], c.unloads.get(reason, 0))
            load_time.add_metric([served.id], c.loads, c.load_seconds)
            failing.add_metric([served.id], served.failures)
        resident = GaugeMetricFamily(
            "specgate_process_resident_memory_bytes",
            "The gateway process's resident memory (on macOS too, where the standard "
            "process_resident_memory_bytes is missing)")  # fmt: skip
        if (rss := process_rss(os.getpid())) is not None:
            resident.add_metric([], rss)
        yield from (state, memory, resident_of, loads, unloads, load_time, failing, budget, resident)

    def _connections(self):
        """The process's file descriptors (on macOS too, where the standard
        process_open_fds and process_max_fds are missing) and the server's
        connections (gateway/server.py, gateway/access/connections.py)."""
        limit = GaugeMetricFamily(
            "specgate_fd_limit", "The soft limit of open files (raised to the hard one at start)"
        )
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            limit.add_metric([], soft)
        yield limit
        try:  # (the listing's own descriptor is one of those listed)
            yield GaugeMetricFamily("specgate_open_fds", "Open file descriptors",
                                    value=len(os.listdir("/dev/fd")) - 1)  # fmt: skip
        except OSError:
            pass
        if (c := self.connections) is None:
            return
        yield GaugeMetricFamily("specgate_connections_open", "HTTP connections open now",
                                value=c.open)  # fmt: skip
        refused = CounterMetricFamily(
            "specgate_connections_refused",
            "Connections closed on arrival: per_client (its address held "
            "server.max_connections_per_client), fd_reserve (too near the open-files limit)",
            labels=["reason"])  # fmt: skip
        for reason, n in c.refused.items():
            refused.add_metric([reason], n)
        yield refused
        yield CounterMetricFamily(
            "specgate_connections_header_timeouts",
            "Connections closed for not sending a request's headers within server.header_timeout_s",
            value=c.header_timeouts)  # fmt: skip

    def _request_cpu(self):
        """A request's CPU work off the event loop: the bounded workers
        (engines/cpu.py) and the grammar compiler's child (engines/grammar/sandbox.py)."""
        yield GaugeMetricFamily("specgate_cpu_jobs", "Tokenizing, templating and grammar jobs "
                                "running or waiting on the bounded workers", value=POOL.pending)  # fmt: skip
        yield CounterMetricFamily("specgate_cpu_jobs_refused", "Jobs refused (429) with the "
                                  "workers' queue full", value=POOL.refused)  # fmt: skip
        compiles = CounterMetricFamily(
            "specgate_grammar_compiles", "Request grammars compiled in the sandbox, by outcome: "
            "ok, refused (did not compile: a 400), crashed (killed the child), timed_out",
            labels=["outcome"])  # fmt: skip
        for outcome, n in SANDBOX.outcomes.items():
            compiles.add_metric([outcome], n)
        yield compiles

    def _prefix_caches(self):
        """The in-process models' prefix caches (engines/cache/prefix_cache.py)."""
        m = "model"
        lookups = CounterMetricFamily("specgate_prefix_cache_lookups",
                                      "Prompts looked up in the prefix cache", labels=[m])
        hits = CounterMetricFamily("specgate_prefix_cache_hits",
                                   "Lookups that resumed from a cached state, by tier",
                                   labels=[m, "tier"])
        hit_tokens = CounterMetricFamily("specgate_prefix_cache_hit_tokens",
                                         "Prompt tokens served from the cache, by tier",
                                         labels=[m, "tier"])
        evictions = CounterMetricFamily("specgate_prefix_cache_evictions",
                                        "Entries evicted from a tier (RAM: the entry may "
                                        "still be on disk)", labels=[m, "tier"])
        nbytes = GaugeMetricFamily("specgate_prefix_cache_bytes", "Bytes held, by tier",
                                   labels=[m, "tier"])
        entries = GaugeMetricFamily("specgate_prefix_cache_entries", "Entries held, by tier",
                                    labels=[m, "tier"])
        refused = CounterMetricFamily("specgate_prefix_cache_refused",
                                      "Disk entries refused (corrupt or foreign) and deleted",
                                      labels=[m])
        restore = SummaryMetricFamily("specgate_prefix_cache_restore_seconds",
                                      "Loading entries from the disk tier", labels=[m])
        for served in self.models.models.values():
            loaded = getattr(served.engine, "loaded", None)
            if loaded is None:
                continue  # llama-server keeps its own
            cache, model = loaded.prefix_cache, [served.id]
            stats, disk = cache.stats, cache.disk
            lookups.add_metric(model, stats.lookups)
            for tier in ("ram", "disk"):
                hits.add_metric([*model, tier], stats.hits[tier])
                hit_tokens.add_metric([*model, tier], stats.hit_tokens[tier])
            evictions.add_metric([*model, "ram"], stats.evictions)
            nbytes.add_metric([*model, "ram"], cache.nbytes)
            entries.add_metric([*model, "ram"], len(cache))
            restore.add_metric(model, stats.restores, stats.restore_seconds)
            if disk is not None:
                evictions.add_metric([*model, "disk"], disk.evictions)
                nbytes.add_metric([*model, "disk"], disk.nbytes)
                entries.add_metric([*model, "disk"], len(disk))
            refused.add_metric(model, disk.refused if disk is not None else 0)
        yield from (lookups, hits, hit_tokens, evictions, nbytes, entries, refused, restore)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
