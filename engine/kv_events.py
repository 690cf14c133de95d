"""KV-cache events as vLLM publishes them (``--kv-events-config``), so one router works over both engines.

The block pool records a ``BlockStored`` when a full, computed block becomes findable by its hash
(its token ids and its parent's hash with it) and a ``BlockRemoved`` when a cached block is evicted
for reuse. After each step the engine thread sends what was recorded as one batch: ZeroMQ PUB frames
``(topic, 8-byte big-endian sequence from 0, msgpack payload)``, the payload the array ``[ts,
events, data_parallel_rank]`` with each event a map tagged by ``"type"``, exactly as vLLM's
``msgspec`` structs encode (vllm/distributed/kv_events.py). A slow subscriber loses batches past the
socket's high-water mark instead of slowing the engine; it sees the gap in the sequence numbers.

Block hashes are the engine's own sha256 chain (``block_pool.chain_block_hashes``); subscribers
need not reproduce it: each ``BlockStored`` carries the tokens to re-hash (router/kv_events.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zmq

from kvfleet.engine.kv_events_replay import ReplayBuffer, ReplayServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields, with the same names and defaults.

    ``replay_endpoint``: a ROUTER socket serving the last ``buffer_steps`` batches to a subscriber that
    joined late or lost some (kv_events_replay.py); always bound, as vLLM does.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``; a ``ValueError`` names the field that is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config: not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config: must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv_events_config.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events: must be true or false")
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config.publisher: must be 'zmq' or 'null', got {self.publisher!r}")
        addresses = {"endpoint": self.endpoint}
        if self.replay_endpoint is not None:
            addresses["replay_endpoint"] = self.replay_endpoint
        for name, address in addresses.items():
            if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config.{name}: must be a tcp://, ipc:// or inproc:// address, got {address!r}"
                )
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("kv_events_config.replay_endpoint: must differ from endpoint")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10_000_000:
                raise ValueError(f"kv_events_config.{name}: must be an integer in [1, 10000000]")
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config.topic: must be a string")


def block_stored(
    block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int
) -> dict[str, Any]:
    """A ``BlockStored`` in msgspec's field order (tag first, defaulted fields left out)."""
    return {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",  # vLLM names the device tier GPU whatever the device; the router reads it so
        "lora_name": None,
    }


def block_removed(block_hashes: list[bytes]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": "GPU"}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects to a collector there).

    vLLM's rule: bind a wildcard (``*``), an IPv6 (``::``), an ``ipc://`` or ``inproc://`` address. A
    loopback address (``tcp://127.0.0.1:N``) is bound too, where vLLM would connect: kvfleet's routers
    connect to the engines, and local mode keeps its engines' events (prompts' token ids) off the network.
    """
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host in LOOPBACK_HOSTS


class ZmqEventPublisher:
    """Sends batches from the engine thread: never blocks it (a full socket drops and counts the batch).

    With ``replay_endpoint`` every numbered batch is also kept for replay (kv_events_replay.py).
    """

    def __init__(self, config: KVEventsConfig, *, clock: Any = time.time) -> None:
        self.config = config
        self._clock = clock
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if binds(config.endpoint):
                self._socket.bind(config.endpoint)
            else:
                self._socket.connect(config.endpoint)
        except zmq.ZMQError as e:
            self._socket.close(0)
            raise ValueError(f"kv_events_config.endpoint: cannot bind {config.endpoint}: {e}") from e
        self.endpoint: str = str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT)) or config.endpoint
        self._topic = config.topic.encode()
        self._seq = 0
        self.sent_batches = 0
        self.dropped_batches = 0
        self.replay: ReplayServer | None = None
        if config.replay_endpoint is not None:
            try:
                self.replay = ReplayServer(config.replay_endpoint, ReplayBuffer(config.buffer_steps), self._topic)
            except ValueError:
                self._socket.close(0)
                raise

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        payload = msgpack.packb([self._clock(), events, 0], use_bin_type=True)
        seq = self._seq
        self._seq += 1  # a dropped batch still takes its number: subscribers see the gap
        if self.replay is not None:
            self.replay.buffer.append(seq, payload)  # kept even if the PUB drops it: a replay brings it back
        try:
            self._socket.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent_batches += 1
        except zmq.Again:
            self.dropped_batches += 1

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self._socket.close(0)
