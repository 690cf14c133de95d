"""Prometheus metrics with vLLM's names and a ``model_name`` label, so the router, the autoscaler
and dashboards read the reference engine and vLLM alike. Each server gets its own registry.

``EngineMetrics`` holds the families and the few ``record_*`` calls through which an engine step
moves them (scheduling, tokens, finishes, load), so the step itself names no metric."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfleet import contracts

if TYPE_CHECKING:
    from kvfleet.engine.scheduler import SchedulerOutput
    from kvfleet.engine.sequence import Sequence

# vLLM's bucket edges, so histogram_quantile() gives comparable answers across engines.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, [contracts.VLLM_MODEL_LABEL]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.num_requests_running = gauge(contracts.VLLM_NUM_REQUESTS_RUNNING, "Requests in model execution batches.")
        self.num_requests_waiting = gauge(contracts.VLLM_NUM_REQUESTS_WAITING, "Requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge(contracts.VLLM_KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(contracts.VLLM_PREFIX_CACHE_QUERIES, "Prefix cache queries, in tokens.")
        self.prefix_cache_hits = counter(contracts.VLLM_PREFIX_CACHE_HITS, "Prefix cache hits, in tokens.")
        self.prompt_tokens = counter(contracts.VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.generation_tokens = counter(contracts.VLLM_GENERATION_TOKENS, "Number of generation tokens processed.")
        self.num_preemptions = counter(contracts.VLLM_NUM_PREEMPTIONS, "Cumulative number of preemptions.")
        self.request_success = Counter(
            contracts.VLLM_REQUEST_SUCCESS,
            "Count of finished requests.",
            [contracts.VLLM_MODEL_LABEL, "finished_reason"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            contracts.VLLM_TTFT_SECONDS, "Time to first token.", labels, buckets=TTFT_BUCKETS_S, registry=r
        )
        self.inter_token_latency = Histogram(
            contracts.VLLM_ITL_SECONDS, "Time between output tokens.", labels, buckets=ITL_BUCKETS_S, registry=r
        )
        self.e2e_request_latency = Histogram(
            contracts.VLLM_E2E_LATENCY_SECONDS, "End-to-end request latency.", labels, buckets=E2E_BUCKETS_S, registry=r
        )
        # kvfleet's own: prompt tokens actually run through the model (prefix hits excluded).
        self.prefill_computed_tokens = counter(
            "kvfleet_engine_prefill_computed_tokens",
            "Prompt tokens computed (prefix hits excluded).",
        )
        self.draining = gauge("kvfleet_engine_draining", "1 while the server drains after SIGTERM.")
        self.model_name = model_name
        # The per-token series, looked up once: ``labels()`` (a locked lookup) cost more than the update.
        self._generation_tokens = self.generation_tokens.labels(model_name)
        self._inter_token_latency = self.inter_token_latency.labels(model_name)
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc, self.draining):
            metric.labels(model_name).set(0)
        for c in (
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.num_preemptions,
            self.prefill_computed_tokens,
        ):
            c.labels(model_name)  # present at 0 before the first request
        for h in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency):
            h.labels(model_name)

    # -- what an engine step records ------------------------------------------------------------
    def record_schedule(self, sched: SchedulerOutput) -> None:
        """A step's scheduling: its preemptions and its admissions' prefix-cache lookups (tokens)."""
        name = self.model_name
        if sched.preempted:
            self.num_preemptions.labels(name).inc(len(sched.preempted))
        self.prefix_cache_queries.labels(name).inc(sched.prefix_queries_tokens)
        self.prefix_cache_hits.labels(name).inc(sched.prefix_hits_tokens)

    def record_prefill(self, computed_tokens: int) -> None:
        self.prefill_computed_tokens.labels(self.model_name).inc(computed_tokens)

    def record_token(self, seq: Sequence, now_s: float) -> None:
        """One generated token: the prompt counted once, TTFT or inter-token latency; moves the
        sequence's token timestamps (they exist for these histograms only)."""
        if not seq.prompt_counted:
            seq.prompt_counted = True
            self.prompt_tokens.labels(self.model_name).inc(seq.num_prompt_tokens)
        if seq.first_token_time_s is None:
            seq.first_token_time_s = now_s
            self.time_to_first_token.labels(self.model_name).observe(max(0.0, now_s - seq.arrival_time_s))
        elif seq.last_token_time_s is not None:
            self._inter_token_latency.observe(max(0.0, now_s - seq.last_token_time_s))
        seq.last_token_time_s = now_s
        self._generation_tokens.inc()

    def record_finish(self, reason: str, e2e_s: float | None) -> None:
        """A finished request; ``e2e_s`` None for an abort, whose latency says nothing about serving."""
        self.request_success.labels(self.model_name, reason).inc()
        if e2e_s is not None:
            self.e2e_request_latency.labels(self.model_name).observe(max(0.0, e2e_s))

    def set_load(self, *, running: int, waiting: int, kv_cache_usage: float) -> None:
        name = self.model_name
        self.num_requests_running.labels(name).set(running)
        self.num_requests_waiting.labels(name).set(waiting)
        self.kv_cache_usage_perc.labels(name).set(kv_cache_usage)
