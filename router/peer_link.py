"""Carries this router's own load counts to the other routers, and theirs in (``peer_load.PeerLoads``).

UDP datagrams, each signed with HMAC-SHA256 under a key every router of the fleet mounts (a report
steers picks, so an unsigned or wrongly signed one is dropped and counted). Every
``peer_load_send_interval_s`` (1 ms) the link compares each model's counts with what it last sent and
sends the replicas that changed: the simulator measured that the counts must arrive within ~1 ms
(docs/router.md, "The fleet's load"), and one look per interval batches a burst of picks into one
datagram. Between looks it sleeps until the fleet says a count moved (``Fleet.load_changed``) or a
full send is due: an idle router wakes a few times a second, not 1,000 (3.5% of a core, measured).
Every ``peer_load_full_interval_s`` it sends every count, so a lost datagram is corrected and
silence means the router is gone (``peer_load_max_age_s``).

A datagram: 32 bytes of HMAC over the rest, then JSON ``{"peer", "seq", "model", "counts": [[replica,
in flight, waiting], ...], "full"}``; at most ``MAX_REPLICAS_PER_DATAGRAM`` replicas each (a model
with more is sent in several; ``full`` marks the first of a full send: the receiver drops what the
peer no longer reports). ``peer`` names this process (host, pid and a random part), so a restarted router
is a new peer and the old one ages out; ``seq`` only grows, so a replayed or late datagram is stale.
Peers are ``host:port`` names, each looked up every ``RESOLVE_EVERY_S`` for all its addresses (a
headless Service's name gives every router pod; at most ``MAX_PEER_ADDRESSES``); a router that finds
itself among them ignores its own datagrams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.router.fleet import Fleet
    from kvfleet.router.settings import RouterSettings

log = logging.getLogger(__name__)

TAG_BYTES = 32
MAX_REPLICAS_PER_DATAGRAM = 256  # ~12 KiB of JSON at most: well under a UDP datagram's 64 KiB
MAX_DATAGRAM_BYTES = 64 * 1024
MAX_PEER_ADDRESSES = 64
RESOLVE_EVERY_S = 5.0  # routers come and go with their pods: peers' names are looked up again this often


def sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest() + body


def verify(key: bytes, data: bytes) -> bytes | None:
    """The body of a datagram signed under ``key``, or None."""
    if len(data) <= TAG_BYTES or len(data) > MAX_DATAGRAM_BYTES:
        return None
    tag, body = data[:TAG_BYTES], data[TAG_BYTES:]
    return body if hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()) else None


def parse(body: bytes) -> tuple[str, int, str, list[tuple[str, int, int]], bool] | str:
    """(peer, seq, model, counts, full), or why the body is refused."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict):
        return "not an object"
    peer, seq, model, counts = doc.get("peer"), doc.get("seq"), doc.get("model"), doc.get("counts")
    if not isinstance(peer, str) or not isinstance(model, str) or not isinstance(seq, int) or isinstance(seq, bool):
        return "peer, model or seq missing or mistyped"
    if not isinstance(counts, list) or len(counts) > MAX_REPLICAS_PER_DATAGRAM:
        return "counts missing or too many"
    out: list[tuple[str, int, int]] = []
    for entry in counts:
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not isinstance(entry[0], str)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in entry[1:])
        ):
            return "a count is not [replica, in flight, waiting]"
        out.append((entry[0], entry[1], entry[2]))
    return peer, seq, model, out, doc.get("full") is True


class PeerLink(asyncio.DatagramProtocol):
    """Sends this router's counts to ``settings.peer_load_peers`` and gives the fleet what peers send."""

    def __init__(
        self, fleet: Fleet, settings: RouterSettings, key: bytes, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if len(key) < 32:
            raise ValueError(f"peer_load_key_file: the key must be at least 32 bytes, got {len(key)}")
        self._fleet = fleet
        self._settings = settings
        self._key = key
        self._clock = clock
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = itertools.count(1)
        self._sent: dict[str, dict[str, tuple[int, int]]] = {}  # model -> replica -> counts last sent
        self._peers: list[tuple[str, int]] = []
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task[None] | None = None
        self.received: Counter[str] = Counter()  # what each datagram came to (PeerLoads.apply's, or why refused)
        self.looks = 0  # times the send loop woke to compare counts (an idle router: a few per second)
        self.port = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        local = (self._settings.host, self._settings.peer_load_port or 0)
        transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=local)
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]
        await self.resolve()
        self._task = loop.create_task(self._send_loop())
        log.info("peer load: %s on port %d, %d peer addresses", self.name, self.port, len(self._peers))

    async def resolve(self) -> None:
        """Every address each ``host:port`` names: a headless Service's name gives every router pod."""
        loop = asyncio.get_running_loop()
        found: set[tuple[str, int]] = set()
        for address in self._settings.peer_load_peers:
            host, _, port = address.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
            except OSError as e:  # not resolvable now (no router pod ready yet): the next look tries again
                log.debug("peer load: %s: %s", address, e)
                continue
            found.update((str(info[4][0]), int(info[4][1])) for info in infos)
        self._peers = sorted(found)[:MAX_PEER_ADDRESSES]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._transport is not None:
            self._transport.close()

    async def _send_loop(self) -> None:
        full_at = resolve_at = 0.0
        while True:
            self.looks += 1
            now = self._clock()
            if now >= resolve_at:
                resolve_at = now + RESOLVE_EVERY_S
                await self.resolve()
            full = now >= full_at
            if full:
                full_at = now + self._settings.peer_load_full_interval_s
            try:
                self.send(full)
            except OSError as e:  # a peer unreachable now: the next look sends again
                log.debug("peer load: send failed: %s", e)
            # At most one look per interval (a burst of picks is one datagram); then sleep until a count
            # moves or the next full send is due, so an idle router does not wake 1,000 times a second.
            await asyncio.sleep(self._settings.peer_load_send_interval_s)
            changed = self._fleet.load_changed
            if not changed.is_set():
                idle_s = min(full_at, resolve_at) - self._clock()
                if idle_s > 0:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that
                    # lands as the event is set, and close() would then wait on this loop forever.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(idle_s):
                            await changed.wait()
            changed.clear()

    def send(self, full: bool) -> None:
        """Send each model's counts that changed since the last send (``full``: all of them)."""
        if self._transport is None or not self._peers:
            return
        for view in self._fleet.models():
            inflight, waiting = self._fleet.inflight(view.key), self._fleet.waiting(view.key)
            now = {r: (n, waiting.get(r, 0)) for r, n in inflight.items()}
            last = self._sent.get(view.key, {})
            changed = [(r, c[0], c[1]) for r, c in now.items() if full or last.get(r) != c]
            self._sent[view.key] = now
            for start in range(0, len(changed), MAX_REPLICAS_PER_DATAGRAM):
                part = changed[start : start + MAX_REPLICAS_PER_DATAGRAM]
                body = {"peer": self.name, "seq": next(self._seq), "model": view.key, "counts": part}
                if full and start == 0:  # every replica (the first part of several): the peer drops the others
                    body["full"] = True
                data = sign(self._key, json.dumps(body, separators=(",", ":")).encode())
                for peer in self._peers:
                    self._transport.sendto(data, peer)
        for key in [k for k in self._sent if self._fleet.view(k) is None]:
            del self._sent[key]  # bounded by the models served

    def datagram_received(self, data: bytes, addr: Any) -> None:
        body = verify(self._key, data)
        if body is None:
            self.received["refused: bad signature"] += 1
            return
        parsed = parse(body)
        if isinstance(parsed, str):
            self.received[f"refused: {parsed}"] += 1
            return
        peer, seq, model, counts, full = parsed
        if peer == self.name:
            return  # this router is in its own list of peers
        peers = self._fleet.peer_loads(model)
        if peers is None:
            self.received["unknown model"] += 1
            return
        known = self._fleet.inflight(model)  # the replicas this router routes to
        self.received[peers.apply(peer, seq, counts, self._clock(), full, known)] += 1

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable from a peer not up yet
        log.debug("peer load: %s", exc)


def read_key(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read().strip()
