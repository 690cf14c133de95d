"""Observations from Prometheus through prometheus-api-client (PromQL in ``promql.py``).

prometheus-api-client is synchronous (requests), so each observation runs its queries in a worker
thread, bounded by the HTTP timeout. Every failure becomes ``Observation.failed`` with a reason
that names the query, never the response body.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.promql import deployment_queries
from kvfleet.autoscaler.settings import PrometheusSourceSettings
from kvfleet.autoscaler.sources import SourceError, Target


def _scalar(result: Any, query_name: str) -> float | None:
    """The value of a one-element instant vector; None for an empty one (no series)."""
    if not isinstance(result, list):
        raise SourceError(f"{query_name}: unexpected result type {type(result).__name__}")
    if not result:
        return None
    try:
        return float(result[0]["value"][1])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise SourceError(f"{query_name}: malformed sample") from e


class PrometheusSource:
    """A ``MetricSource`` over a Prometheus HTTP API."""

    def __init__(self, settings: PrometheusSourceSettings, client: PrometheusConnect | None = None) -> None:
        self.settings = settings
        # One quick retry at most: the loop ticks again in seconds, and a retry storm against a
        # struggling Prometheus helps no one (the library's default backs off for seconds).
        retry = Retry(total=1, backoff_factor=0.0, status_forcelist=(502, 503, 504), allowed_methods=("GET",))
        self._client = client or PrometheusConnect(
            url=settings.url, disable_ssl=False, timeout=settings.timeout_s, retry=retry
        )

    def _query_all(self, target: Target) -> dict[str, float | None]:
        queries = deployment_queries(
            target.served_name, target.namespace, target.name, self.settings.rate_window, self.settings.names
        )
        values: dict[str, float | None] = {}
        for name, query in queries.items():
            try:
                result = self._client.custom_query(query, timeout=self.settings.timeout_s)
            except requests.exceptions.RequestException as e:
                raise SourceError(f"prometheus unreachable ({type(e).__name__}) on {name}") from e
            except PrometheusApiClientException as e:
                raise SourceError(f"prometheus rejected the {name} query: {str(e)[:200]}") from e
            values[name] = _scalar(result, name)
        return values

    async def observe(self, target: Target, now_s: float) -> Observation:
        try:
            values = await asyncio.to_thread(self._query_all, target)
        except SourceError as e:
            return Observation.failed(now_s, str(e), ready_replicas=target.ready_replicas)
        return observation_from_values(values, target, now_s)

    async def close(self) -> None:
        session = getattr(self._client, "_session", None)
        if session is not None:
            session.close()


def observation_from_values(values: dict[str, float | None], target: Target, now_s: float) -> Observation:
    """Assemble an Observation from per-signal values (None = no series)."""
    ttft = values.get("ttft_p90_s")
    if ttft is not None and math.isnan(ttft):
        ttft = None  # no request finished its first token in the window: no TTFT, not an error
    times = [values.get("router_sample_at_s")]
    if target.ready_replicas > 0:
        times.append(values.get("engine_sample_at_s"))
    known = [t for t in times if t is not None]
    # The oldest of the components' newest samples: one silent component makes the whole stale.
    sampled_at = min(known) if known else now_s
    return Observation(
        sampled_at_s=sampled_at,
        ready_replicas=target.ready_replicas,
        engine_concurrency=values.get("engine_concurrency"),
        router_in_flight=values.get("router_in_flight"),
        queue_depth=values.get("queue_depth"),
        arrival_rate_rps=values.get("arrival_rate_rps"),
        kv_cache_utilization=values.get("kv_cache_utilization"),
        gpu_utilization=values.get("gpu_utilization"),
        ttft_p90_s=ttft,
        measured_cold_start_s=target.measured_cold_start_s,
    )
