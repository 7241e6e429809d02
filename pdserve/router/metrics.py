"""Prometheus metrics of the request stages and the worker roles, named ``pdserve:*`` (vLLM's
names where vLLM has one), on a registry this object owns.

`observe()` once per finished request; `render()` at ``GET /metrics`` with the roles' loads.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from pdserve.router.roles import ReplicaLoad
from pdserve.router.timings import RequestTimings

# Latencies from 1 ms (a cached tokenize) to 2 min (a long prompt on CPU).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0)
# Per-token gaps sit between 1 ms (GPU) and a few seconds (CPU under load).
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
# 4 KiB (one tiny block) to 4 GiB (a long prompt of a large model), x4 steps.
BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(1, 12))
NO_PATH_LABEL = "none"
# Why requests were answered 429 or 503 instead of being served (`OverloadedError.kind`,
# `ServiceUnavailableError.kind`); listed so that each shows from the first scrape, at 0.
REFUSAL_REASONS = ("in_flight_limit", "kv_cache_full", "draining", "no_decode_replica",
                   "decode_gone", "worker_died", "unavailable", "overloaded",
                   "worker_backpressure")

# (metric suffix, RequestTimings field in ms, help) of the unlabeled stage histograms.
_STAGES = (
    ("tokenize_seconds", "tokenize_ms", "Chat template and tokenization time."),
    ("decode_reserve_seconds", "decode_reserve_ms", "Time to reserve KV blocks on decode."),
    ("prefill_queue_seconds", "prefill_queue_ms", "Wait before a prefill worker started."),
    ("prefill_compute_seconds", "prefill_compute_ms", "Prefill compute time."),
    ("handoff_seconds", "handoff_ms", "KV handoff time, ticket issued to verified fence "
     "(overlaps the prefill it streams from)."),
    ("handoff_exposed_seconds", "handoff_exposed_ms",
     "Handoff time left after prefill compute ended (not hidden by overlap)."),
)


class PdserveMetrics:
    """All pdserve metrics of one process, on its own `CollectorRegistry`.

    A registry per object (not the global default) lets tests and several apps in one process
    coexist. Each ingress replica exports its own numbers; Prometheus sums across replicas.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._add_request_metrics(r)
        self._add_kv_metrics(r)
        self._add_replica_gauges(r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        self._ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token.",
                               ["path"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._tpot = Histogram("pdserve:request_time_per_output_token_seconds", "A request's "
                               "mean time per output token after the first.", ["path"],
                               buckets=TPOT_BUCKETS_S, registry=r)
        self._itl = Histogram("pdserve:inter_token_latency_seconds", "Time between output "
                              "tokens as the client received them (tokens that arrived "
                              "together share their gap).", ["path"], buckets=TPOT_BUCKETS_S,
                              registry=r)
        self._e2e = Histogram("pdserve:e2e_request_latency_seconds", "Whole request latency.",
                              ["path"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._stages = tuple(
            (field, Histogram(f"pdserve:{name}", help_text, buckets=LATENCY_BUCKETS_S, registry=r))
            for name, field, help_text in _STAGES)
        self._handoff_bytes = Histogram("pdserve:handoff_bytes", "KV bytes moved per request.",
                                        buckets=BYTES_BUCKETS, registry=r)
        self._prefix_hit = Counter("pdserve:prefix_hit_tokens", "Prompt tokens served from a "
                                   "prefix cache.", registry=r)
        self._prefill_computed = Counter("pdserve:prefill_tokens_computed", "Prompt tokens "
                                         "computed by prefill (any worker).", registry=r)
        self._prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens received.",
                                      registry=r)
        self._output_tokens = Counter("pdserve:generation_tokens", "Tokens generated.",
                                      registry=r)
        self._requests = Counter("pdserve:requests", "Finished requests.", ["status", "path"],
                                 registry=r)
        self._fallbacks = Counter("pdserve:fallbacks", "Requests that left their planned path "
                                  "(e.g. handoff failed, decode recomputed; prefill busy or "
                                  "gone, decode prefilled).", ["reason"], registry=r)
        self._handoff_failures = Counter("pdserve:handoff_failures", "KV handoffs that failed, "
                                         "by what failed.", ["reason"], registry=r)
        self._refused = Counter("pdserve:requests_refused", "Requests answered 429 or 503 "
                                "instead of being served, by the limit or state that refused "
                                "them.", ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self._refused.labels(reason=reason)
        self._inconsistent = Counter(
            "pdserve:inconsistent_outputs", "Generations stopped with an error because a "
            "worker's tokens did not continue the ones their client had (never sent as text).",
            registry=r)
        self._in_flight = Gauge("pdserve:num_requests_in_flight", "Requests this ingress "
                                "admitted that have not finished (n choices count n), against "
                                "router.max_in_flight_requests.", registry=r)

    def _add_kv_metrics(self, r: CollectorRegistry) -> None:
        self._cache_queries = Counter("pdserve:prefix_cache_queries", "Prompt tokens looked "
                                      "up in the prefix caches (vLLM's name).", registry=r)
        self._cache_hits = Counter("pdserve:prefix_cache_hits", "Prompt tokens reused instead "
                                   "of computed, by the tier their KV came from (device, host, "
                                   "...); misses are queries minus hits.", ["tier"], registry=r)
        self._load_choices = Counter("pdserve:kv_load_decisions", "Requests whose prefix "
                                     "continued in another tier, by that tier and the measured "
                                     "choice (load or recompute).", ["tier", "choice"],
                                     registry=r)
        self._load_bytes = Counter("pdserve:kv_load_bytes", "KV bytes loaded from a tier.",
                                   ["tier"], registry=r)
        self._load_seconds = Histogram("pdserve:kv_load_seconds", "Time to load a prefix's KV "
                                       "from a tier into device blocks, verified.", ["tier"],
                                       buckets=LATENCY_BUCKETS_S, registry=r)
        self._load_failures = Counter("pdserve:kv_load_failures", "Chosen loads that failed and "
                                      "were computed instead, by reason.", ["tier", "reason"],
                                      registry=r)

    def _add_replica_gauges(self, r: CollectorRegistry) -> None:
        replica = ["role", "replica"]
        self._kv_usage = Gauge("pdserve:kv_cache_usage_perc", "Fraction of a replica's KV "
                               "blocks in use (cached-only blocks count as free).", replica,
                               registry=r)
        self._running = Gauge("pdserve:num_requests_running", "Requests a replica is "
                              "computing.", replica, registry=r)
        self._waiting = Gauge("pdserve:num_requests_waiting", "Requests a replica holds that "
                              "wait to be scheduled (or for their KV).", replica, registry=r)
        self._host_usage = Gauge("pdserve:kv_host_cache_usage_perc", "Fraction of a replica's "
                                 "host-tier blocks holding cached KV.", replica, registry=r)
        self._loading = Gauge("pdserve:num_requests_loading_kv", "Requests a replica holds "
                              "whose prompt prefix is loading from another tier (host, store "
                              "or a peer worker).", replica, registry=r)
        self._lent_steps = Gauge("pdserve:cpu_lent_steps", "Engine steps a replica ran with "
                                 "idle workers' cores lent to it (engine.cpu_lending), so far.",
                                 replica, registry=r)

    def observe(self, timings: RequestTimings) -> None:
        """Record one finished request (any status)."""
        path = timings.path or NO_PATH_LABEL
        self._requests.labels(status=timings.status, path=path).inc()
        if timings.fallback_reason is not None:
            self._fallbacks.labels(reason=timings.fallback_reason).inc()
        if timings.handoff_error is not None:
            self._handoff_failures.labels(reason=timings.handoff_error).inc()
        for value, histogram in ((timings.ttft_ms, self._ttft), (timings.tpot_ms, self._tpot),
                                 (timings.e2e_ms, self._e2e)):
            if value is not None:
                histogram.labels(path=path).observe(value / 1000.0)
        for field, histogram in self._stages:
            value = getattr(timings, field)
            if value is not None:
                histogram.observe(value / 1000.0)
        if timings.handoff_bytes is not None:
            self._handoff_bytes.observe(timings.handoff_bytes)
        self._prefix_hit.inc(timings.prefix_hit_tokens)
        self._observe_tiers(timings)
        self._prefill_computed.inc(timings.num_prefill_tokens_computed)
        self._prompt_tokens.inc(timings.num_prompt_tokens)
        self._output_tokens.inc(timings.num_output_tokens)

    def _observe_tiers(self, timings: RequestTimings) -> None:
        self._cache_queries.inc(timings.num_prompt_tokens)
        self._cache_hits.labels(tier="device").inc(
            max(0, timings.prefix_hit_tokens - timings.kv_loaded_tokens))
        tier = timings.kv_tier or "host"
        if timings.kv_loaded_tokens:
            self._cache_hits.labels(tier=tier).inc(timings.kv_loaded_tokens)
            self._load_bytes.labels(tier=tier).inc(timings.kv_load_bytes)
            if timings.kv_load_ms is not None:
                self._load_seconds.labels(tier=tier).observe(timings.kv_load_ms / 1000.0)
        if timings.kv_load_choice is not None:
            self._load_choices.labels(tier=tier, choice=timings.kv_load_choice).inc()
        if timings.kv_load_failure is not None:
            self._load_failures.labels(tier=tier, reason=timings.kv_load_failure).inc()

    def observe_inconsistent_output(self, _error: Exception | None = None) -> None:
        self._inconsistent.inc()

    def observe_refusal(self, reason: str) -> None:
        self._refused.labels(reason=reason).inc()

    def observe_token_gaps(self, path: str | None, gaps_s: Sequence[float]) -> None:
        histogram = self._itl.labels(path=path or NO_PATH_LABEL)
        for gap in gaps_s:
            histogram.observe(gap)

    def render(self, loads: Sequence[ReplicaLoad] = (), num_in_flight: int = 0) -> bytes:
        """The Prometheus text exposition of every metric, for ``GET /metrics``, with the
        roles' latest reported loads."""
        self._in_flight.set(num_in_flight)
        for gauge in (self._kv_usage, self._running, self._waiting, self._host_usage,
                      self._loading, self._lent_steps):
            gauge.clear()
        for load in loads:
            labels = {"role": load.role, "replica": load.replica_id}
            self._kv_usage.labels(**labels).set(load.kv_usage)
            self._running.labels(**labels).set(load.num_running)
            self._waiting.labels(**labels).set(load.num_waiting)
            self._loading.labels(**labels).set(load.num_loading)
            self._lent_steps.labels(**labels).set(load.num_lent_steps)
            if load.num_host_blocks:
                self._host_usage.labels(**labels).set(
                    load.num_host_cached_blocks / load.num_host_blocks)
        return generate_latest(self.registry)
