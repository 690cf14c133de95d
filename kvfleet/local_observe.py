"""Fill the autoscaler's ``Observation`` for one local deployment, from the engines or from Prometheus.

Direct (the default): the router runs in this process, so its queue, in-flight counts and answered
requests are read from memory; the engines' vLLM metrics are scraped from each replica. Prometheus
(``--prometheus URL`` or ``--with-prometheus``): the same signals by PromQL, with the sample time
taken from the router's newest scrape, so a Prometheus that stopped scraping (or is down) yields a
stale or failed observation and the policy holds instead of scaling to zero on absent data.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_client import CollectorRegistry
from urllib3.util.retry import Retry

from kvfleet.autoscaler.observation import Observation
from kvfleet.local_metrics import EngineSample


@dataclass(frozen=True)
class RouterView:
    """What the in-process router knows about one served model right now."""

    queue_depth: int
    inflight: int
    answered_total: float


def router_answered_total(registry: CollectorRegistry, served_name: str) -> float:
    """Requests the router answered for ``served_name`` (any status), from its own registry."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "kvfleet_router_requests_total" and sample.labels.get("model") == served_name:
                total += sample.value
    return total


@dataclass
class DirectSource:
    """Observations from in-process router state plus direct engine scrapes."""

    _last_answered: tuple[float, float] | None = None

    def observe(
        self, now_s: float, ready_replicas: int, engines: Mapping[str, EngineSample], router: RouterView
    ) -> Observation:
        rate: float | None = None
        if self._last_answered is not None and now_s > self._last_answered[0]:
            rate = max(0.0, router.answered_total - self._last_answered[1]) / (now_s - self._last_answered[0])
        self._last_answered = (now_s, router.answered_total)
        concurrency = sum(s.running + s.waiting for s in engines.values()) if engines else None
        kv = sum(s.kv_cache_usage for s in engines.values()) / len(engines) if engines else None
        return Observation(
            sampled_at_s=now_s,
            ready_replicas=ready_replicas,
            engine_concurrency=concurrency,
            router_in_flight=float(router.inflight),
            queue_depth=float(router.queue_depth),
            arrival_rate_rps=rate if rate is not None else 0.0,
            kv_cache_utilization=kv,
        )


def _label(value: str) -> str:
    # PromQL string literal: escape backslash and quote (served names are already restricted).
    return value.replace("\\", "\\\\").replace('"', '\\"')


def promql_queries(served_name: str, rate_window_s: float) -> dict[str, str]:
    """One PromQL expression per Observation field, engines by ``model_name``, router by ``model``."""
    m = _label(served_name)
    window = f"{max(1, math.ceil(rate_window_s))}s"
    return {
        "sampled_at_s": f'max(timestamp(kvfleet_router_queue_depth{{model="{m}"}}))',
        "queue_depth": f'sum(kvfleet_router_queue_depth{{model="{m}"}})',
        "router_in_flight": f'sum(kvfleet_router_inflight{{model="{m}"}})',
        "arrival_rate_rps": f'sum(rate(kvfleet_router_requests_total{{model="{m}"}}[{window}]))',
        "engine_concurrency": (
            f'sum(vllm:num_requests_running{{model_name="{m}"}}) + sum(vllm:num_requests_waiting{{model_name="{m}"}})'
        ),
        "kv_cache_utilization": f'avg(vllm:kv_cache_usage_perc{{model_name="{m}"}})',
    }


def _scalar(result: Any) -> float | None:
    if not result:
        return None
    return float(result[0]["value"][1])


@dataclass
class PrometheusSource:
    """Observations by PromQL (prometheus-api-client, run off the event loop)."""

    url: str
    rate_window_s: float = 10.0
    timeout_s: float = 5.0
    _client: PrometheusConnect | None = None

    def _query_all(self, served_name: str) -> dict[str, float | None]:
        if self._client is None:
            # No retries: a failed query is reported at once and the policy holds; the next tick asks again.
            self._client = PrometheusConnect(url=self.url, disable_ssl=True, retry=Retry(total=0))
        client = self._client
        return {
            field: _scalar(client.custom_query(query, timeout=math.ceil(self.timeout_s)))
            for field, query in promql_queries(served_name, self.rate_window_s).items()
        }

    async def observe(self, now_s: float, served_name: str, ready_replicas: int) -> Observation:
        query: Callable[[str], dict[str, float | None]] = self._query_all
        try:
            values = await asyncio.wait_for(asyncio.to_thread(query, served_name), self.timeout_s * 2)
        except TimeoutError:
            return Observation.failed(now_s, f"Prometheus at {self.url} did not answer in {self.timeout_s * 2:g}s")
        except (PrometheusApiClientException, requests.RequestException, ValueError, KeyError, IndexError) as e:
            return Observation.failed(now_s, f"Prometheus at {self.url}: {type(e).__name__}: {e}")
        sampled = values.pop("sampled_at_s")
        if sampled is None:
            return Observation.failed(now_s, f"Prometheus at {self.url} has no router samples for {served_name!r} yet")
        return Observation(
            sampled_at_s=sampled,
            ready_replicas=ready_replicas,
            engine_concurrency=values["engine_concurrency"],
            router_in_flight=values["router_in_flight"],
            queue_depth=values["queue_depth"],
            arrival_rate_rps=values["arrival_rate_rps"],
            kv_cache_utilization=values["kv_cache_utilization"],
        )
