"""Asking an engine's KV-event replay socket for the batches a subscription missed (vLLM's protocol).

vLLM's publisher (``replay_endpoint`` in ``--kv-events-config``) and the reference engine keep their
last ``buffer_steps`` batches on a ZeroMQ ROUTER socket: a client sends ``("", start)`` (8-byte
big-endian) and gets each buffered batch numbered from ``start`` as ``("", topic, sequence,
payload)``, then an end marker ``("", "", -1, "")``. The router asks from 0 when it (re)connects,
so a restarted router rebuilds what the engine holds instead of waiting for it to be stored again,
and from the first missing number when it sees a gap.

The I/O only: ``replay`` yields raw ``(sequence, payload)`` pairs for the subscription to decode and
apply like live ones, and ends with an outcome that is a metric label. Bounds: each message must
arrive within ``idle_s``, the whole replay within ``total_s``, and at most ``max_batches`` are
taken. An engine without a replay socket (a vLLM started without ``replay_endpoint``) never
answers: the replay ends as ``timeout`` after ``idle_s`` and the subscription goes on as before,
its view partial. Each replay uses its own DEALER socket, closed at the end, so a late answer to an
abandoned replay can never be read as part of the next one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import zmq
import zmq.asyncio

END_SEQ = -1


@dataclass(frozen=True)
class ReplayLimits:
    idle_s: float = 1.0  # no answer within this: no replay socket there, or it is stuck
    total_s: float = 10.0
    max_batches: int = 20_000  # vLLM keeps 10,000 by default


@dataclass
class ReplayOutcome:
    """How a replay ended: ``done`` (the end marker), ``timeout``, ``malformed``, ``too-many`` or
    ``socket``; and how many batches it yielded."""

    reason: str = "done"
    batches: int = 0
    detail: str = ""


async def replay(
    endpoint: str, start: int, limits: ReplayLimits, outcome: ReplayOutcome
) -> AsyncGenerator[tuple[int, bytes], None]:
    """The publisher's buffered batches numbered from ``start``, in its order; ``outcome`` says how it ended."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, limits.max_batches + 1)
    deadline = time.monotonic() + limits.total_s
    try:
        sock.connect(endpoint)
        await sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        while True:
            wait_s = min(limits.idle_s, deadline - time.monotonic())
            if wait_s <= 0 or not await sock.poll(int(wait_s * 1000)):
                outcome.reason, outcome.detail = "timeout", f"no answer from {endpoint} within {limits.idle_s:g} s"
                return
            frames = await sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                outcome.reason = "malformed"
                outcome.detail = f"expected 4 frames ('', topic, sequence, payload), got {len(frames)}"
                return
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return
            if outcome.batches >= limits.max_batches:
                outcome.reason, outcome.detail = "too-many", f"more than {limits.max_batches} batches"
                return
            outcome.batches += 1
            yield seq, frames[3]
    except zmq.ZMQError as e:
        outcome.reason, outcome.detail = "socket", str(e)
    finally:
        sock.close(0)
