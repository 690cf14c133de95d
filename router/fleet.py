"""The router's live view of its deployments: replicas with their in-flight and awaiting-first-byte
counts, the prefix index, outlier ejection, and the hold queue. ``acquire`` picks a replica (holding
the request while the model has none) and hands out a ``ReplicaLease`` (replica_lease.py), whose
``with`` block reports how the attempt went.

Models are keyed by ``namespace/served-name`` (``DeploymentView.key``); every method that takes a
model name also takes the bare served name, which the source guarantees one deployment holds
(``replicas.resolve_claims``). Per-model metrics carry (namespace, served name)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfleet.router.activator import HoldBudget, HoldQueue
from kvfleet.router.engine_caches import EngineCaches
from kvfleet.router.errors import ModelNotFoundError
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.model_tokenizers import ModelTokenizers
from kvfleet.router.outlier import OutlierDetector
from kvfleet.router.peer_load import PeerLoads
from kvfleet.router.picking import Candidate, Pick, PickRequest, Strategy, build_strategy
from kvfleet.router.placement import BranchIndex, home
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.router.prompt import BlockChain
from kvfleet.router.replica_lease import ReplicaLease, ReplicaLoad
from kvfleet.router.replicas import DeploymentView, Endpoint, Snapshot
from kvfleet.router.settings import RouterSettings
from kvfleet.router.wake import WakeRepeater, WakeSignal

if TYPE_CHECKING:
    from kvfleet.router.kv_subscriber import EventSubscription
    from kvfleet.router.prompt_tokens import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass
class _Model:
    view: DeploymentView
    index: PrefixIndex
    strategy: Strategy
    queue: HoldQueue
    branches: BranchIndex | None  # where prompts diverge, for placement (None: placement off)
    caches: EngineCaches | None = None  # the replicas' KV-cache event views (None: events off)
    subscriptions: dict[str, EventSubscription] = field(default_factory=dict)
    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    peers: PeerLoads = field(default_factory=PeerLoads)  # the other routers' reported counts (peer_load.py)
    first_seen_unix_s: int = field(default_factory=lambda: int(time.time()))
    # When a request first found no replica taking requests (the wake began), on the fleet's clock;
    # None while one does. Subtracted from the cold-start estimate: what a held client is told is left.
    waking_since_s: float | None = None


class Fleet:
    """Implements ``FleetSink``; every method runs on the event loop's thread."""

    def __init__(
        self,
        settings: RouterSettings,
        wake: WakeSignal,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._waker = WakeRepeater(wake, interval_s=settings.wake_min_interval_s, timeout_s=settings.wake_timeout_s)
        self._metrics = metrics
        self._clock = clock
        self._models: dict[str, _Model] = {}  # by DeploymentView.key
        self._served: dict[str, str] = {}  # served name -> key
        self._outliers = OutlierDetector(
            failures_to_eject=settings.eject_after_failures,
            base_ejection_s=settings.eject_base_s,
            max_ejection_s=max(settings.eject_max_s, settings.eject_base_s),
        )
        self._stopping: set[asyncio.Task[None]] = set()
        self._holds = HoldBudget(settings.max_held_requests)
        metrics.track_holds(lambda: (self._holds.held, self._holds.max_held, self._holds.refused))
        self.applied = asyncio.Event()
        # Set whenever a replica's in-flight or waiting count moves: the peer link sends only then.
        self.load_changed = asyncio.Event()
        metrics.track_inflight(self._inflight_samples)
        # Mounted ones loaded now (a missing one stops the router at start); others fetched from replicas.
        self._tokenizers = ModelTokenizers(settings, metrics, self._install_tokenizer)
        if settings.kv_events_port is not None:
            metrics.track_kv_events(self._kv_event_samples)

    def _kv_event_samples(self) -> list[tuple[str, str, int, int, int]]:
        return [
            (*model.view.labels, len(model.subscriptions), model.caches.usable_count(), model.caches.blocks())
            for model in self._models.values()
            if model.caches is not None
        ]

    def _inflight_samples(self) -> list[tuple[str, str, str, int, int]]:
        return [
            (*model.view.labels, r, rep.inflight, rep.waiting)
            for model in self._models.values()
            for r, rep in model.replicas.items()
        ]

    # -- FleetSink -------------------------------------------------------------------------------

    def apply(self, snapshot: Snapshot) -> None:
        wanted: dict[str, DeploymentView] = {}
        served: dict[str, str] = {}  # served name -> key
        for view in snapshot.values():
            if view.served_name in served:
                # Sources resolve claims already (resolve_claims); a second claimant is never routed.
                log.warning("snapshot serves %r twice; %s is not routed", view.served_name, view.key)
                continue
            wanted[view.key] = view
            served[view.served_name] = view.key
        for key in [m for m in self._models if m not in wanted]:
            gone = self._models.pop(key)
            for replica_id in gone.replicas:
                self._outliers.forget(replica_id)
            for replica_id in list(gone.subscriptions):
                self._unsubscribe(gone, replica_id)
            gone.queue.release_all()  # waiters look again and find the model gone: 404
            self._tokenizers.forget(gone.view)
            self._metrics.forget_model(gone.view.labels)
        self._served = served
        for key, view in wanted.items():
            served_name = view.served_name
            found = self._models.get(key)
            if found is None:
                index = PrefixIndex(self._settings.prefix_index_blocks_per_replica)
                caches = (
                    EngineCaches(self._settings.kv_events_max_blocks_per_replica)
                    if self._settings.kv_events_port is not None
                    else None
                )
                model = _Model(
                    view=view,
                    index=index,
                    caches=caches,
                    peers=PeerLoads(self._settings.peer_load_max_age_s),
                    strategy=self._strategy(view, index, caches),
                    queue=HoldQueue(
                        served_name,
                        max_waiting=view.routing.max_queue,
                        retry_after_s=self._settings.retry_after_s,
                        budget=self._holds,
                    ),
                    branches=(
                        BranchIndex(self._settings.placement_branch_entries, self._settings.placement_max_depth_blocks)
                        if self._settings.placement
                        else None
                    ),
                )
                self._models[key] = model
                self._metrics.queue_depth.labels(*view.labels).set(0)
            else:
                model = found
            if model.view.routing != view.routing:
                model.strategy = self._strategy(view, model.index, model.caches)
                model.queue.max_waiting = view.routing.max_queue
            model.view = view
            self._apply_endpoints(model, view.endpoints)
            self._tokenizers.offer(view)  # fetched from a replica where none is mounted (tokenizer_fetch.py)
            if any(not r.endpoint.draining for r in model.replicas.values()):
                model.waking_since_s = None
                model.queue.release_all()
        self.applied.set()

    def _apply_endpoints(self, model: _Model, endpoints: Sequence[Endpoint]) -> None:
        wanted = {e.replica_id: e for e in endpoints}
        for replica_id in [r for r in model.replicas if r not in wanted]:
            # In-flight requests to it hold their own URL and finish; only the router's memory of it goes.
            del model.replicas[replica_id]
            self._outliers.forget(replica_id)
            model.peers.forget_replica(replica_id)
            self._unsubscribe(model, replica_id)
        for replica_id, endpoint in wanted.items():
            replica = model.replicas.get(replica_id)
            if replica is None:
                model.replicas[replica_id] = ReplicaLoad(endpoint)
            elif replica.endpoint != endpoint:
                if replica.endpoint.url != endpoint.url:
                    model.index.forget(replica_id)  # a new process behind the same id has a cold cache
                if (replica.endpoint.url, replica.endpoint.kv_events_port) != (endpoint.url, endpoint.kv_events_port):
                    self._unsubscribe(model, replica_id)  # subscribed again below, to the new address
                replica.endpoint = endpoint
            model.index.set_capacity(replica_id, endpoint.kv_capacity_blocks)
            if model.caches is not None and replica_id not in model.subscriptions and self._publishes(endpoint):
                self._subscribe(model, endpoint)
        model.index.retain(wanted)

    def _install_tokenizer(self, key: str, tokenizer: PromptTokenizer) -> bool:
        """A fetched tokenizer: the model's prompts are tokenized from the next request on."""
        model = self._models.get(key)
        if model is not None:
            model.strategy.prefix.use_tokenizer(tokenizer)
        return model is not None

    def _publishes(self, endpoint: Endpoint) -> bool:
        """Whether to subscribe to the replica: it names its events port, or every replica is tried."""
        return endpoint.kv_events_port is not None or not self._settings.kv_events_announced_only

    def _subscribe(self, model: _Model, endpoint: Endpoint) -> None:
        from kvfleet.router.kv_subscriber import subscribe

        assert model.caches is not None
        subscribe(model.view.labels, model.caches, model.subscriptions, endpoint, self._settings, self._metrics)

    def _unsubscribe(self, model: _Model, replica_id: str) -> None:
        subscription = model.subscriptions.pop(replica_id, None)
        if subscription is not None:
            self._stopping.add(asyncio.get_running_loop().create_task(subscription.stop()))
            self._stopping = {t for t in self._stopping if not t.done()}
        if model.caches is not None:
            model.caches.remove(replica_id)

    def _strategy(self, view: DeploymentView, index: PrefixIndex, caches: EngineCaches | None) -> Strategy:
        return build_strategy(
            view.routing,
            index,
            load_penalty_blocks=self._settings.load_penalty_blocks,
            placement=self._settings.placement,
            load_bound_slack=self._settings.load_bound_slack_requests,
            caches=caches,
            model=view.served_name,
            max_prompt_blocks=self._settings.max_prompt_blocks,
            tokenizer=self._tokenizers.get(view.served_name),
        )

    # -- queries ---------------------------------------------------------------------------------

    def models(self) -> list[DeploymentView]:
        return [m.view for m in self._models.values()]

    def _find(self, model_name: str) -> _Model | None:
        """``namespace/served-name`` (always exact) first, then a bare served name."""
        model = self._models.get(model_name)
        if model is not None:
            return model
        key = self._served.get(model_name)
        return self._models.get(key) if key is not None else None

    def view(self, model_name: str) -> DeploymentView | None:
        """The deployment a request's ``model`` names: qualified ``namespace/served-name`` or bare."""
        model = self._find(model_name)
        return model.view if model else None

    def created_unix_s(self, model_name: str) -> int:
        """The model object's ``created``: the deployment's creation time, else when this router first saw it."""
        model = self._require(model_name)
        return model.view.created_unix_s or model.first_seen_unix_s

    def prompt_blocks(self, model_name: str, body: dict[str, Any]) -> BlockChain:
        """The request's prompt as the model's prefix scorer hashes it (``prefix_scorer.PrefixScorer.hashes``)."""
        return self._require(model_name).strategy.prefix.hashes(body)

    def inflight(self, served_name: str) -> dict[str, int]:
        model = self._find(served_name)
        return {r: rep.inflight for r, rep in model.replicas.items()} if model else {}

    def waiting(self, served_name: str) -> dict[str, int]:
        """Requests per replica sent and not yet answered with a first body byte."""
        model = self._find(served_name)
        return {r: rep.waiting for r, rep in model.replicas.items()} if model else {}

    def queue_depth(self, served_name: str) -> int:
        model = self._find(served_name)
        return len(model.queue) if model else 0

    def index_entries(self, served_name: str | None = None) -> int:
        if served_name is not None:
            model = self._find(served_name)
            return model.index.entries() if model else 0
        return sum(m.index.entries() for m in self._models.values())

    def index(self, served_name: str) -> PrefixIndex | None:
        model = self._find(served_name)
        return model.index if model else None

    def engine_caches(self, served_name: str) -> EngineCaches | None:
        model = self._find(served_name)
        return model.caches if model else None

    def engine_blocks_job(
        self, served_name: str, body: dict[str, Any], hashes: Sequence[int]
    ) -> Callable[[], None] | None:
        """The model's prefix scorer's tokenizing job (``PrefixScorer.engine_blocks_job``), or None."""
        if not self._tokenizers:  # no model is tokenized (KV events off): nothing to look up per request
            return None
        model = self._find(served_name)
        return model.strategy.prefix.engine_blocks_job(body, hashes) if model is not None else None

    # -- acquire / release -----------------------------------------------------------------------

    def try_acquire(
        self, served_name: str, hashes: Sequence[int], exclude: frozenset[str] = frozenset()
    ) -> ReplicaLease | None:
        """A replica for one attempt now, or None when the model has none taking requests (see ``acquire``)."""
        model = self._require(served_name)
        return self._try_pick(model, hashes, exclude, self._clock())

    def _try_pick(
        self, model: _Model, hashes: Sequence[int], exclude: frozenset[str], now_s: float
    ) -> ReplicaLease | None:
        if self._outliers.none_ejected(now_s):
            replicas = model.replicas.items()
            candidates = [Candidate(r, rep.inflight, rep.endpoint.draining, False, rep.waiting) for r, rep in replicas]
        else:
            is_ejected = self._outliers.is_ejected
            candidates = [
                Candidate(r, rep.inflight, rep.endpoint.draining, is_ejected(r, now_s), rep.waiting)
                for r, rep in model.replicas.items()
            ]
        picked_from = model.peers.add_to(candidates, now_s)  # the fleet's load where peers report it
        branches = model.branches
        key, block = home(branches, hashes) if branches is not None else (None, 0)
        if key is not None:
            self._metrics.placement_keyed.inc(model.view.labels)
        if isinstance(hashes, BlockChain) and hashes.engine_blocks is not None:
            request = PickRequest(hashes, exclude, key, block, hashes.engine_blocks, hashes.engine_block_size)
        else:
            request = PickRequest(hashes, exclude, key, block)
        pick = model.strategy.pick(picked_from, request)
        return self._lease(model, pick, request) if pick is not None else None

    def peer_loads(self, model_name: str) -> PeerLoads | None:  # the other routers' counts (peer_link.py)
        model = self._find(model_name)
        return model.peers if model else None

    async def acquire(
        self, served_name: str, hashes: Sequence[int], exclude: frozenset[str] = frozenset()
    ) -> ReplicaLease:
        """A replica for one attempt, holding the request while the model has none ready."""
        model = self._require(served_name)
        deadline_s = self._clock() + model.view.routing.max_queue_wait_seconds
        while True:
            now_s = self._clock()
            lease = self._try_pick(model, hashes, exclude, now_s)
            if lease is not None:
                return lease
            # No replica takes new requests (none yet, or all draining): hold the request, wake the autoscaler.
            if model.waking_since_s is None:
                model.waking_since_s = now_s
            self._waker.start(model.view.key, self._needs_wake)
            self._metrics.queue_depth.labels(*model.view.labels).set(len(model.queue) + 1)
            try:
                await model.queue.wait(deadline_s - now_s)
            finally:
                self._metrics.queue_depth.labels(*model.view.labels).set(len(model.queue))
            model = self._require(model.view.key)

    def cold_start(self, model_name: str) -> tuple[DeploymentView, float]:
        """The model's view (its ``cold_start``) and how long it has been waking (0 when it is not)."""
        model = self._require(model_name)
        since = model.waking_since_s
        return model.view, 0.0 if since is None else max(0.0, self._clock() - since)

    def wake_once(self, model_name: str) -> None:
        """Send the model's wake signal once without holding a request (one answered 503 at once still
        wakes the deployment for its retry); the wake's clock starts now if it has not."""
        model = self._require(model_name)
        if model.waking_since_s is None:
            model.waking_since_s = self._clock()
        self._waker.once(model.view.key, model.view.namespace, model.view.name)

    def _lease(self, model: _Model, pick: Pick, request: PickRequest) -> ReplicaLease:
        replica = model.replicas[pick.replica_id]
        model.strategy.learn(pick, request)  # learn only after the pick
        replica.inflight += 1
        replica.waiting += 1
        self.load_changed.set()
        self._metrics.prefix_match.observe(model.view.labels, pick.match_ratio)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pick %s", pick.reason)
        url, changed = replica.endpoint.url, self.load_changed.set
        return ReplicaLease(model.view.key, pick.replica_id, url, pick, replica, self._release, changed)

    def _release(self, lease: ReplicaLease, outcome: str) -> None:
        self.load_changed.set()
        if outcome == "ok":
            self._outliers.record_success(lease.replica_id)
        elif outcome == "failed":
            ejected_s = self._outliers.record_failure(lease.replica_id, self._clock())
            if ejected_s is not None:
                log.warning("replica %s of %s ejected for %.1fs", lease.replica_id, lease.model, ejected_s)

    def _require(self, model_name: str) -> _Model:
        model = self._find(model_name)
        if model is None:
            raise ModelNotFoundError(f"model {model_name!r} is not served here")
        return model

    def _needs_wake(self, key: str) -> tuple[str, str] | None:
        """The deployment to wake: requests are held and no replica takes them (none, or all draining)."""
        model = self._models.get(key)
        if model is None or not len(model.queue):
            return None
        if any(not r.endpoint.draining for r in model.replicas.values()):
            return None
        return model.view.namespace, model.view.name

    async def close(self) -> None:
        for model in self._models.values():
            for replica_id in list(model.subscriptions):
                self._unsubscribe(model, replica_id)
        await asyncio.gather(*self._stopping, return_exceptions=True)
        await self._tokenizers.close()
        await self._waker.close()
