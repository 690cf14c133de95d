"""A KV-event publisher the router tests drive (vLLM's PUB framing, batches built by hand), and waiting
for a fleet's subscription to it to be in use: shared by the event-subscription and tokenizer-fetch tests."""

from __future__ import annotations

import asyncio
import time

import msgpack
import zmq

from kvfleet.router.fleet import Fleet


class Publisher:
    """A bound PUB socket speaking vLLM's framing: (topic, 8-byte sequence, msgpack batch)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seq = 0
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Binding again right after a close may find ZeroMQ's I/O thread still releasing the port.
        deadline = time.monotonic() + 5
        while True:
            try:
                self.sock.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def send_raw(self, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        self.sock.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def store(self, tokens: list[int], first: int, parent: int | None = None, block_size: int = 4) -> None:
        n = len(tokens) // block_size
        event = {
            "type": "BlockStored",
            "block_hashes": list(range(first, first + n)),
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        self.send_raw(msgpack.packb([1.0, [event], 0]))

    def close(self) -> None:
        self.sock.close(0)


def usable(fleet: Fleet, replica: str, model: str = "m") -> bool:
    """Whether the replica's event view is in use (connected, a batch received since)."""
    caches = fleet.engine_caches(model)
    state = caches.get(replica) if caches else None
    return bool(state and state.usable)


async def publish_until_usable(fleet: Fleet, publisher: Publisher, replica: str, tokens: list[int], first: int) -> None:
    """PUB drops what it sends before a subscriber is connected: resend (as new batches) until one lands."""
    for _ in range(200):
        publisher.store(tokens, first)
        await asyncio.sleep(0.02)
        if usable(fleet, replica):
            return
    raise AssertionError(f"{replica} never became usable")
