"""The PromQL the Prometheus source runs for each deployment, in one place.

Every selector names the deployment's namespace and its served name, so two namespaces serving one
name never mix. Engines are selected by ``namespace`` (the Prometheus Operator's target label: the
operator's ServiceMonitor for a deployment's engines lives in its namespace) and ``model_name``
(vLLM's label, which the reference engine copies). The router is selected by its own ``namespace``
and ``model`` labels (the deployment's namespace and served name; the chart's router
ServiceMonitor sets honorLabels so Prometheus keeps them instead of the router pod's namespace).
GPU utilization comes from NVIDIA's DCGM exporter, whose pods carry the Kubernetes ``namespace``
and ``pod`` labels of the GPU's consumer; engine pods are named ``<name>-engine-...``.

Per signal (``{m}`` served name, ``{ns}`` namespace, ``{pod}`` pod-name regex, ``{rate}`` window;
``E`` is ``namespace="{ns}",model_name="{m}"`` and ``R`` is ``namespace="{ns}",model="{m}"``):

- engine_concurrency: ``sum({__name__=~"vllm:num_requests_(running|waiting)",E})``
- router_in_flight: ``sum(kvfleet_router_inflight{R})``
- queue_depth: ``sum(kvfleet_router_queue_depth{R})``
- arrival_rate_rps: ``sum(rate(kvfleet_router_requests_total{R}[{rate}]))``
- kv_cache_utilization: ``avg(vllm:kv_cache_usage_perc{E})``
- gpu_utilization: ``avg(DCGM_FI_DEV_GPU_UTIL{namespace="{ns}",pod=~"{pod}"}) / 100``
- ttft_p90_s: ``histogram_quantile(0.9, sum by (le)
  (rate(vllm:time_to_first_token_seconds_bucket{E}[{rate}])))``
- engine_sample_at_s: ``max(timestamp(vllm:num_requests_running{E}))``
- router_sample_at_s: ``max(timestamp(kvfleet_router_queue_depth{R})
  or timestamp(kvfleet_router_inflight{R}))``

The two ``timestamp`` queries give the time of the newest sample (an instant query answers at the
evaluation time, up to 5 minutes after the last sample, so its own time says nothing about age).
``kvfleet_router_requests_total`` counts answered requests; at the rate window's scale that is
the arrival rate, minus the requests still in flight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvfleet.contracts import (
    ROUTER_INFLIGHT,
    ROUTER_QUEUE_DEPTH,
    ROUTER_REQUESTS,
    VLLM_KV_CACHE_USAGE,
    VLLM_NUM_REQUESTS_RUNNING,
    VLLM_NUM_REQUESTS_WAITING,
    VLLM_PREFIX_CACHE_HITS,
    VLLM_PREFIX_CACHE_QUERIES,
    VLLM_REQUEST_SUCCESS,
    VLLM_TTFT_SECONDS,
    engine_pod_regex,
)
from kvfleet.spec import NAME_PATTERN

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9._/:-]{1,253}$")
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h)$")


def label_value(value: str) -> str:
    """A served name or namespace as a PromQL string literal's content.

    Names come from the API (validated there too); refusing anything outside the served-name
    alphabet here keeps a crafted name from changing a query's meaning.
    """
    if not _LABEL_VALUE.match(value):
        raise ValueError(f"{value!r} is not a valid label value for a PromQL selector")
    return value


@dataclass(frozen=True)
class MetricNames:
    """Metric names, overridable when an engine or exporter names them differently."""

    # Matches VLLM_NUM_REQUESTS_RUNNING and VLLM_NUM_REQUESTS_WAITING (tests/api/test_contracts.py).
    engine_running_waiting_regex: str = "vllm:num_requests_(running|waiting)"
    engine_running: str = VLLM_NUM_REQUESTS_RUNNING
    engine_waiting: str = VLLM_NUM_REQUESTS_WAITING
    kv_cache_usage: str = VLLM_KV_CACHE_USAGE
    ttft_bucket: str = f"{VLLM_TTFT_SECONDS}_bucket"
    # Counters local mode's view reads (named without the exposition's ``_total`` suffix).
    requests_done: str = VLLM_REQUEST_SUCCESS
    prefix_cache_queries: str = VLLM_PREFIX_CACHE_QUERIES
    prefix_cache_hits: str = VLLM_PREFIX_CACHE_HITS
    router_inflight: str = ROUTER_INFLIGHT
    router_queue_depth: str = ROUTER_QUEUE_DEPTH
    router_requests_total: str = f"{ROUTER_REQUESTS}_total"
    gpu_utilization_percent: str = "DCGM_FI_DEV_GPU_UTIL"


def deployment_queries(
    served_name: str, namespace: str, name: str, rate_window: str = "1m", names: MetricNames | None = None
) -> dict[str, str]:
    """Signal name -> PromQL for one deployment (see the module docstring for the table)."""
    if not _DURATION.match(rate_window):
        raise ValueError(f"rate window {rate_window!r} is not a PromQL duration like 1m or 30s")
    n = names or MetricNames()
    m = label_value(served_name)
    ns = label_value(namespace)
    if not re.match(NAME_PATTERN, name):
        # A DNS-1035 label has no regex metacharacters, so it goes into the pod regex as is.
        raise ValueError(f"{name!r} is not a valid InferenceDeployment name")
    pod = engine_pod_regex(name)
    e = f'namespace="{ns}",model_name="{m}"'
    r = f'namespace="{ns}",model="{m}"'
    engines = f'{{__name__=~"{n.engine_running_waiting_regex}",{e}}}'
    router_q = f"{n.router_queue_depth}{{{r}}}"
    router_i = f"{n.router_inflight}{{{r}}}"
    return {
        "engine_concurrency": f"sum({engines})",
        "router_in_flight": f"sum({router_i})",
        "queue_depth": f"sum({router_q})",
        "arrival_rate_rps": f"sum(rate({n.router_requests_total}{{{r}}}[{rate_window}]))",
        "kv_cache_utilization": f"avg({n.kv_cache_usage}{{{e}}})",
        "gpu_utilization": f'avg({n.gpu_utilization_percent}{{namespace="{ns}",pod=~"{pod}"}}) / 100',
        "ttft_p90_s": f"histogram_quantile(0.9, sum by (le) (rate({n.ttft_bucket}{{{e}}}[{rate_window}])))",
        # timestamp() drops the metric name, so one metric per timestamp() (running and waiting
        # of one engine would otherwise collide into one label set).
        "engine_sample_at_s": f"max(timestamp({n.engine_running}{{{e}}}))",
        "router_sample_at_s": f"max(timestamp({router_q}) or timestamp({router_i}))",
    }
