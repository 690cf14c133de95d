"""One ZeroMQ SUB subscription per replica to its KV-cache events, feeding its ``ReplicaEvents``.

The I/O layer only: decoding and applying are ``kv_events`` and ``engine_caches``. Bounds:
- ZeroMQ queues at most ``kv_events_queue_batches`` per replica (RCVHWM) and drops past it; the
  sequence gap that leaves is seen and counted;
- at most ``kv_events_max_batches_per_s`` batches are applied per replica per second (a token
  bucket); more are dropped and counted, and the view stops claiming to be complete;
- each batch is bounded by ``DecodeLimits`` and each view by ``kv_events_max_blocks_per_replica``.
ZeroMQ reconnects by itself; each subscription's first delay is ``kv_events_reconnect_s`` jittered
0.5-1.5x (so routers do not reconnect to a restarted engine in step), doubling up to
``kv_events_reconnect_max_s``. A socket monitor says when the connection is up or down: while down
the replica is scored by the learned index. A bad batch is logged (rate-limited) and counted, never
raised: nothing here can fail a request.

Replay (``kv_events_replay``, kv_replay.py): on each connection the subscription first asks the
engine's replay socket (the events port + 1) for every batch it still buffers, from 0, and applies
them before reading the live stream, so a router that restarts or joins sees what the engine holds
(complete while the engine's buffer still starts at batch 0). A live batch already replayed is a
duplicate and skipped. A gap in the live numbers is asked for again (at most once per
``REPLAY_INTERVAL_S``, at most ``GAP_REPLAY_MAX_BATCHES`` back), the live batch held until the
missing ones are applied, so the view stays complete. The SUB socket is not read while a replay
runs; ZeroMQ queues what arrives meanwhile (``kv_events_queue_batches``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvfleet.contracts import kv_events_replay_port
from kvfleet.router.engine_caches import ReplicaEvents
from kvfleet.router.kv_events import DecodeLimits, KVEventError, decode_batch, decode_frames
from kvfleet.router.kv_replay import ReplayLimits, ReplayOutcome, replay
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.settings import RouterSettings
from kvfleet.token_bucket import TokenBucket

if TYPE_CHECKING:
    from kvfleet.router.engine_caches import EngineCaches
    from kvfleet.router.replicas import Endpoint

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # one warning per subscription and reason at most this often
# At most one replay per subscription this often: a publisher that keeps dropping batches (a flood past
# the rate) or its connection is not replayed in a loop; what is then missed leaves the view partial.
REPLAY_INTERVAL_S = 5.0
GAP_REPLAY_MAX_BATCHES = 1_000  # a wider gap is left: the view goes partial, as without replay
YIELD_EVERY_BATCHES = 64  # a long replay lets the event loop serve requests between its batches


class EventSubscription:
    def __init__(
        self,
        model: tuple[str, str],
        replica_id: str,
        endpoint: str,
        state: ReplicaEvents,
        settings: RouterSettings,
        metrics: RouterMetrics,
        *,
        limits: DecodeLimits | None = None,
        replay_endpoint: str | None = None,
    ) -> None:
        self.model = model
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.state = state
        self._settings = settings
        self._metrics = metrics
        self._limits = limits or DecodeLimits()
        self._bucket = TokenBucket(settings.kv_events_max_batches_per_s)
        self._logged: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._replay_limits = ReplayLimits(idle_s=settings.kv_events_replay_idle_s)
        self._replayed_through: int | None = None  # this connection's last replayed number
        self._replay_at = -REPLAY_INTERVAL_S

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.replica_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.state.on_disconnected()

    async def _run(self) -> None:
        s = self._settings
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, s.kv_events_queue_batches)
        first_ms = max(1, int(s.kv_events_reconnect_s * 1000 * random.uniform(0.5, 1.5)))  # noqa: S311 (jitter, no secret)
        sock.setsockopt(zmq.RECONNECT_IVL, first_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(first_ms, int(s.kv_events_reconnect_max_s * 1000)))
        sock.setsockopt(zmq.SUBSCRIBE, s.kv_events_topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sock.connect(self.endpoint)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready and self._on_monitor(parse_monitor_message(await monitor.recv_multipart())):
                    await self._replay(0, until=None)  # everything the engine still buffers
                if sock in ready:
                    await self._on_frames(await sock.recv_multipart())
        except zmq.ZMQError as e:  # a bad endpoint: the replica stays on the learned index
            self._warn("socket", f"subscription to {self.endpoint} failed: {e}")
        finally:
            self.state.on_disconnected()
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _on_monitor(self, message: Mapping[str, Any]) -> bool:
        """Track the connection; True when it just came up (time to replay)."""
        if message["event"] == zmq.EVENT_CONNECTED:
            self.state.on_connected()
            self._replayed_through = None
            self._metrics.kv_event_connections.inc((*self.model, "connected"))
            log.info("kv events of %s: connected to %s", self.replica_id, self.endpoint)
            return self.replay_endpoint is not None
        elif message["event"] == zmq.EVENT_DISCONNECTED:
            self.state.on_disconnected()
            self._metrics.kv_event_connections.inc((*self.model, "disconnected"))
            log.warning(
                "kv events of %s: %s disconnected; scored by the learned index until it is back",
                self.replica_id,
                self.endpoint,
            )
        return False

    async def _on_frames(self, frames: list[bytes]) -> None:
        """Decode and apply one live batch; every failure is counted and logged, none raised."""
        if not self._bucket.take():
            self.state.view.complete = False  # what it said is lost
            self._reject("rate", f"more than {self._settings.kv_events_max_batches_per_s} batches/s; dropped")
            return
        try:
            seq, payload = decode_frames(frames)
        except KVEventError as e:
            self.state.view.complete = False
            self._reject(e.reason, e.detail)
            return
        if self._replayed_through is not None and 0 <= seq <= self._replayed_through:
            self._metrics.kv_event_batches.inc((*self.model, "duplicate"))  # the replay brought it already
            return
        expected = self.state.seq.next
        if expected is not None and expected < seq <= expected + GAP_REPLAY_MAX_BATCHES:
            await self._replay(expected, until=seq)  # the missing ones first, so the view stays complete
        self._apply(seq, payload)

    async def _replay(self, start: int, *, until: int | None) -> None:
        """Apply the publisher's buffered batches from ``start`` (up to ``until``, excluded) in order, unless
        there is no replay socket or the last replay was under ``REPLAY_INTERVAL_S`` ago."""
        now = time.monotonic()
        if self.replay_endpoint is None or now - self._replay_at < REPLAY_INTERVAL_S:
            return
        self._replay_at = now
        outcome = ReplayOutcome()
        async with contextlib.aclosing(replay(self.replay_endpoint, start, self._replay_limits, outcome)) as batches:
            async for seq, payload in batches:
                if until is not None and seq >= until:
                    break  # the live stream brings these
                self._apply(seq, payload)
                if until is None:
                    self._replayed_through = seq  # the live stream brings these again: duplicates
                if outcome.batches % YIELD_EVERY_BATCHES == 0:
                    await asyncio.sleep(0)
        self._metrics.kv_event_replays.inc((*self.model, outcome.reason))
        if outcome.reason != "done":
            self._warn(f"replay-{outcome.reason}", f"replay from {start} ended: {outcome.reason}: {outcome.detail}")

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload, self._limits)
        except KVEventError as e:
            self.state.view.complete = False
            self._reject(e.reason, e.detail)
            return
        kind, result = self.state.on_batch(seq, batch)
        self._metrics.kv_event_batches.inc((*self.model, kind))
        if kind in ("gap", "resync", "restart"):
            self._warn(kind, f"batch {seq}: {kind} (lost or restarted batches; the view starts over or is partial)")
        if result is not None and result.skipped:
            for reason, blocks in result.skipped.items():
                self._metrics.kv_event_blocks_skipped.inc((*self.model, reason), blocks)

    def _reject(self, reason: str, detail: str) -> None:
        self._metrics.kv_event_rejects.inc((*self.model, reason))
        self._warn(reason, f"batch rejected: {reason}: {detail}")

    def _warn(self, reason: str, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning("kv events of %s (%s): %s", self.replica_id, self.endpoint, message)


def subscribe(
    labels: tuple[str, str],
    caches: EngineCaches,
    subscriptions: MutableMapping[str, EventSubscription],
    endpoint: Endpoint,
    settings: RouterSettings,
    metrics: RouterMetrics,
) -> None:
    """Subscribe to the replica's KV-cache events at its host and its (or the configured) port; their
    replay socket is the next port (``contracts.kv_events_replay_port``)."""
    host = urlsplit(endpoint.url).hostname or ""
    port = endpoint.kv_events_port or settings.kv_events_port
    if port is None:
        raise ValueError(f"replica {endpoint.replica_id!r}: no KV events port (kv_events_port is not set)")

    def address(port: int) -> str:
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    replay_endpoint = address(kv_events_replay_port(port)) if settings.kv_events_replay else None
    subscription = EventSubscription(
        labels,
        endpoint.replica_id,
        address(port),
        caches.add(endpoint.replica_id),
        settings,
        metrics,
        replay_endpoint=replay_endpoint,
    )
    subscriptions[endpoint.replica_id] = subscription
    subscription.start()
