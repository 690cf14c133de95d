"""The router's own Prometheus metrics (``kvfleet_router_*``), in a registry per router instance.

Per-model series carry ``namespace`` and ``model``: the deployment's namespace and its served name
(two namespaces' series never mix, docs/router.md). Both are always a known deployment's (requests
for unknown models count under ``namespace="",model=""``), so a client cannot grow the label set by
sending random model names.

The per-request series (requests, retries, upstream timeouts, TTFT, prefix match) are plain counts in dicts, exported
by a collector when scraped, instead of ``prometheus_client`` Counter and Histogram children: those
take a lock and run the bucket search in Python on every update, ~4 us of the router's CPU per
request under wrk (py-spy). The exposition (names, labels, buckets) is the same.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvfleet.contracts import ROUTER_INFLIGHT, ROUTER_QUEUE_DEPTH, ROUTER_REQUESTS

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)

_Value = TypeVar("_Value")


class _Series(Generic[_Value]):
    """A metric's name, help and label names, and its values by label tuple."""

    def __init__(self, name: str, documentation: str, label_names: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.label_names = list(label_names)
        self.values: dict[tuple[str, ...], _Value] = {}

    def forget(self, model: tuple[str, str]) -> None:
        """Drop every series whose first labels (namespace, model) are ``model``."""
        for labels in [k for k in self.values if k[:2] == model]:
            del self.values[labels]


class CounterSeries(_Series[float]):
    """A labelled counter: ``inc(labels)`` is one dict update."""

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.label_names)
        for labels, value in list(self.values.items()):
            family.add_metric(list(labels), value)
        return family


class HistogramSeries(_Series[list[float]]):
    """A labelled histogram: ``observe`` is a C bisect and two list updates; cumulated when scraped.

    Each value is the per-bucket counts (+Inf last), then the sum.
    """

    def __init__(self, name: str, documentation: str, label_names: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, label_names)
        self.bounds = [float(b) for b in buckets]

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.values.get(labels)
        if counts is None:
            counts = self.values[labels] = [0.0] * (len(self.bounds) + 2)
        counts[bisect.bisect_left(self.bounds, value)] += 1.0  # le: a value equal to a bound counts in it
        counts[-1] += value

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        edges = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        for labels, counts in list(self.values.items()):
            cumulative, buckets = 0.0, []
            for edge, count in zip(edges, counts[:-1], strict=True):
                cumulative += count
                buckets.append((edge, cumulative))
            family.add_metric(list(labels), buckets, counts[-1])
        return family


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = CounterSeries(
            ROUTER_REQUESTS,
            "Requests answered, by served model and HTTP status code.",
            ["namespace", "model", "code"],
        )
        self.queue_depth = Gauge(
            ROUTER_QUEUE_DEPTH,
            "Requests held while the model has no ready replica.",
            ["namespace", "model"],
            registry=self.registry,
        )
        self.ttft = HistogramSeries(
            "kvfleet_router_ttft_seconds",
            "Time from receiving a request to forwarding the first response byte.",
            ["namespace", "model"],
            TTFT_BUCKETS_S,
        )
        self.prefix_match = HistogramSeries(
            "kvfleet_router_prefix_match_ratio",
            "Fraction of the prompt's blocks the picked replica was believed to hold.",
            ["namespace", "model"],
            RATIO_BUCKETS,
        )
        self.retries = CounterSeries(
            "kvfleet_router_retries",
            "Attempts retried on another replica after failing before the first byte.",
            ["namespace", "model"],
        )
        self.upstream_timeouts = CounterSeries(
            "kvfleet_router_upstream_timeouts",
            "Waits on a replica that ran out, by phase: pool (no connection came free within pool_wait_timeout_s: "
            "503), connect (connect_timeout_s: tried elsewhere), head (no response headers within "
            "idle_read_timeout_s: 504), body (silence within idle_read_timeout_s after the headers).",
            ["namespace", "model", "phase"],
        )
        self.placement_keyed = CounterSeries(
            "kvfleet_router_placement_keyed",
            "Picks whose prompt had a placement home (where its conversation or document starts was known).",
            ["namespace", "model"],
        )
        self.migrations = CounterSeries(
            "kvfleet_router_stream_migrations",
            "Streams a replica broke after the first byte, by result: continued (on another replica), "
            "completed_tail (only the end was missing), not_continuable, attempts_exhausted, timeout.",
            ["namespace", "model", "result"],
        )
        self.migration_gap = HistogramSeries(
            "kvfleet_router_stream_migration_gap_seconds",
            "From a replica breaking a stream to the continuation's first byte (the added time to next token).",
            ["namespace", "model"],
            TTFT_BUCKETS_S,
        )
        self.kv_event_batches = CounterSeries(
            "kvfleet_router_kv_event_batches",
            "KV-cache event batches received, by what their sequence number meant: first, ok, gap (batches lost), "
            "restart (the engine started over), resync (resumed after a reconnection with batches lost), duplicate.",
            ["namespace", "model", "result"],
        )
        self.kv_event_rejects = CounterSeries(
            "kvfleet_router_kv_event_rejects",
            "KV-cache event batches not applied, by reason: malformed, oversized, framing, unknown-event, rate.",
            ["namespace", "model", "reason"],
        )
        self.kv_event_blocks_skipped = CounterSeries(
            "kvfleet_router_kv_event_blocks_skipped",
            "Stored blocks not taken into a replica's view, by reason: unknown-parent, other-tier, extra-keys, "
            "block-size, overflow (past kv_events_max_blocks_per_replica).",
            ["namespace", "model", "reason"],
        )
        self.kv_event_connections = CounterSeries(
            "kvfleet_router_kv_event_connections",
            "KV-cache event subscription transitions: connected, disconnected.",
            ["namespace", "model", "event"],
        )
        self.kv_event_replays = CounterSeries(
            "kvfleet_router_kv_event_replays",
            "Replays asked of an engine's replay socket, by how they ended: done, timeout (no replay socket), "
            "malformed, too-many, socket.",
            ["namespace", "model", "outcome"],
        )
        self.tokenizer_fetches = CounterSeries(
            "kvfleet_router_tokenizer_fetches",
            "Fetches of a model's tokenizer from a replica's launcher, by outcome: ok, unreachable, timeout, "
            "status (an HTTP refusal), oversize, missing (no tokenizer.json), invalid (would not load), write (the "
            "router's temporary folder refused the files), error.",
            ["namespace", "model", "outcome"],
        )
        self.cold_start_holds = CounterSeries(
            "kvfleet_router_cold_start_holds",
            "Requests held while their model had no ready replica, by outcome: served (a replica took it), "
            "timeout (none within routing.maxQueueWaitSeconds), refused (503 at once: the wake's estimate exceeds "
            "the hold bound), client_gone (the client left while held), gone (the model was removed).",
            ["namespace", "model", "outcome"],
        )
        self.cold_start_hold_time = HistogramSeries(
            "kvfleet_router_cold_start_hold_seconds",
            "Time a request was held waiting for a replica, whatever the outcome but refused (answered at once).",
            ["namespace", "model"],
            TTFT_BUCKETS_S,
        )
        self.cold_start_comments = CounterSeries(
            "kvfleet_router_cold_start_comments",
            "SSE comment lines sent to held streams while their model woke (cold_start_comments).",
            ["namespace", "model"],
        )
        self._series: list[CounterSeries | HistogramSeries] = [
            self.cold_start_holds,
            self.cold_start_hold_time,
            self.cold_start_comments,
            self.tokenizer_fetches,
            self.kv_event_batches,
            self.kv_event_replays,
            self.kv_event_rejects,
            self.kv_event_blocks_skipped,
            self.kv_event_connections,
            self.migrations,
            self.migration_gap,
            self.requests,
            self.ttft,
            self.prefix_match,
            self.retries,
            self.upstream_timeouts,
            self.placement_keyed,
        ]
        self.registry.register(_SeriesCollector(self._series))

    def track_inflight(self, inflight: Callable[[], Iterable[tuple[str, str, str, int, int]]]) -> None:
        """Export ``kvfleet_router_inflight{namespace,model,replica}`` and
        ``kvfleet_router_awaiting_first_byte{namespace,model,replica}`` from ``inflight()``'s (namespace,
        model, replica, in flight, awaiting first byte) at scrape time.

        Read when scraped rather than set on every request: two gauge updates per request were ~3 us of
        the router's CPU per request, and a replica that leaves simply stops being reported.
        """
        self.registry.register(_InflightCollector(inflight))

    def track_front_end(self, refusals: Callable[[], dict[int, int]], connections: Callable[[], int]) -> None:
        """Export ``kvfleet_router_front_end_refusals{code}`` (requests and connections the HTTP server
        refused before the proxy saw them: 400 malformed, 408 slow head, 413, 431, 503 connection cap)
        and ``kvfleet_router_client_connections``, read when scraped."""
        self.registry.register(_FrontEndCollector(refusals, connections))

    def track_holds(self, holds: Callable[[], tuple[int, int, int]]) -> None:
        """Export the router-wide hold budget from ``holds()``'s (held, limit, refused), read when scraped:
        ``kvfleet_router_held_requests``, ``kvfleet_router_held_requests_limit`` and
        ``kvfleet_router_hold_budget_refusals_total`` (429s because the whole router held its limit)."""
        self.registry.register(_HoldCollector(holds))

    def track_kv_events(self, views: Callable[[], Iterable[tuple[str, str, int, int, int]]]) -> None:
        """Export ``kvfleet_router_kv_event_subscriptions{namespace,model}``, ``..._usable`` and
        ``kvfleet_router_kv_event_view_blocks`` from ``views()``'s (namespace, model, subscriptions,
        usable, blocks), read when scraped."""
        self.registry.register(_KVEventsCollector(views))

    def track_token_caches(self, caches: Callable[[], Iterable[tuple[str, int, int, int, int]]]) -> None:
        """Export ``kvfleet_router_token_cache_{hits,misses,evictions}_total{model}`` and
        ``kvfleet_router_token_cache_tokens{model}`` from ``caches()``'s (served name, hits, misses,
        evictions, tokens held), read when scraped: the prompt-piece caches of tokenized models."""
        self.registry.register(_TokenCacheCollector(caches))

    def track_peer_load(self, received: Callable[[], dict[str, int]]) -> None:
        """Export ``kvfleet_router_peer_load_reports_total{outcome}``: other routers' load reports by what
        became of them (peer_link.py: applied, stale, refused: <why>, unknown model), read when scraped."""
        self.registry.register(_PeerLoadCollector(received))

    def forget_model(self, model: tuple[str, str]) -> None:
        """Drop a deployment's series: ``model`` is its (namespace, served name)."""
        for series in self._series:
            series.forget(model)
        with contextlib.suppress(KeyError):
            self.queue_depth.remove(*model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SeriesCollector(Collector):
    def __init__(self, series: Sequence[CounterSeries | HistogramSeries]) -> None:
        self._series = series

    def collect(self) -> Iterator[Metric]:
        for series in self._series:
            yield series.collect()


class _InflightCollector(Collector):
    def __init__(self, inflight: Callable[[], Iterable[tuple[str, str, str, int, int]]]) -> None:
        self._inflight = inflight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            ROUTER_INFLIGHT, "Requests in flight to a replica.", labels=["namespace", "model", "replica"]
        )
        waiting = GaugeMetricFamily(
            "kvfleet_router_awaiting_first_byte",
            "Requests sent to a replica that have had no response body byte yet (queued or prefilling).",
            labels=["namespace", "model", "replica"],
        )
        for namespace, model, replica_id, count, awaiting in self._inflight():
            family.add_metric([namespace, model, replica_id], count)
            waiting.add_metric([namespace, model, replica_id], awaiting)
        yield family
        yield waiting


class _FrontEndCollector(Collector):
    def __init__(self, refusals: Callable[[], dict[int, int]], connections: Callable[[], int]) -> None:
        self._refusals = refusals
        self._connections = connections

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "kvfleet_router_front_end_refusals",
            "Requests and connections refused by the HTTP front end before routing, by HTTP status.",
            labels=["code"],
        )
        for code, count in sorted(self._refusals().items()):
            refused.add_metric([str(code)], count)
        yield refused
        yield GaugeMetricFamily("kvfleet_router_client_connections", "Open client connections.", self._connections())


class _PeerLoadCollector(Collector):
    def __init__(self, received: Callable[[], dict[str, int]]) -> None:
        self._received = received

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvfleet_router_peer_load_reports",
            "Load reports from other routers by what became of them (applied, stale, refused: <why>).",
            labels=["outcome"],
        )
        for outcome, count in sorted(self._received().items()):
            family.add_metric([outcome], count)
        yield family


class _HoldCollector(Collector):
    def __init__(self, holds: Callable[[], tuple[int, int, int]]) -> None:
        self._holds = holds

    def collect(self) -> Iterator[Metric]:
        held, limit, refused = self._holds()
        yield GaugeMetricFamily(
            "kvfleet_router_held_requests", "Requests held across all models while they have no ready replica.", held
        )
        yield GaugeMetricFamily(
            "kvfleet_router_held_requests_limit", "The router-wide hold budget (max_held_requests).", limit
        )
        yield CounterMetricFamily(
            "kvfleet_router_hold_budget_refusals",
            "Requests answered 429 because the router already held max_held_requests across all models.",
            value=refused,
        )


class _KVEventsCollector(Collector):
    def __init__(self, views: Callable[[], Iterable[tuple[str, str, int, int, int]]]) -> None:
        self._views = views

    def collect(self) -> Iterator[Metric]:
        subs = GaugeMetricFamily(
            "kvfleet_router_kv_event_subscriptions",
            "Replicas whose KV-cache events this router subscribes to.",
            labels=["namespace", "model"],
        )
        usable = GaugeMetricFamily(
            "kvfleet_router_kv_event_subscriptions_usable",
            "Subscriptions connected and in sync: their replicas are scored by their engines' events.",
            labels=["namespace", "model"],
        )
        blocks = GaugeMetricFamily(
            "kvfleet_router_kv_event_view_blocks",
            "Blocks held in the replicas' event views.",
            labels=["namespace", "model"],
        )
        for namespace, model, n, live, held in self._views():
            subs.add_metric([namespace, model], n)
            usable.add_metric([namespace, model], live)
            blocks.add_metric([namespace, model], held)
        yield subs
        yield usable
        yield blocks


class _TokenCacheCollector(Collector):
    def __init__(self, caches: Callable[[], Iterable[tuple[str, int, int, int, int]]]) -> None:
        self._caches = caches

    def collect(self) -> Iterator[Metric]:
        doc = "Chat-prompt pieces {} by the router's token cache (KV events: router/token_cache.py)."
        hits = CounterMetricFamily("kvfleet_router_token_cache_hits", doc.format("found"), labels=["model"])
        misses = CounterMetricFamily("kvfleet_router_token_cache_misses", doc.format("tokenized"), labels=["model"])
        evictions = CounterMetricFamily(
            "kvfleet_router_token_cache_evictions", doc.format("dropped past the bound"), labels=["model"]
        )
        tokens = GaugeMetricFamily(
            "kvfleet_router_token_cache_tokens", "Token ids held by the router's token cache.", labels=["model"]
        )
        for model, hit, missed, evicted, held in self._caches():
            hits.add_metric([model], hit)
            misses.add_metric([model], missed)
            evictions.add_metric([model], evicted)
            tokens.add_metric([model], held)
        yield hits
        yield misses
        yield evictions
        yield tokens
