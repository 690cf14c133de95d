"""The KV-event publisher's replay socket, as vLLM serves it (``replay_endpoint`` in ``--kv-events-config``).

A subscriber that joins late (a restarted router) or sees a gap in the sequence numbers asks for the
batches it missed: it sends an 8-byte big-endian start sequence to a ZeroMQ ROUTER socket and gets
every buffered batch numbered from there, one message each ``(topic, sequence, payload)``, then an
end marker ``("", -1, "")``. That is vLLM's protocol (``ZmqEventPublisher._service_replay``), so one
router replays from either engine.

The buffer holds the last ``buffer_steps`` batches (vLLM's field and default, 10,000). A view replayed
from batch 0 is complete; once batch 0 has left the buffer a replay gives what was stored since its
oldest batch, and the subscriber knows (its first sequence number is not 0).

Where this differs from vLLM, on purpose:
- every numbered batch is buffered, also one the PUB socket dropped past its high-water mark, so a
  subscriber that saw that gap gets it back;
- replies are sent without blocking; past the socket's high-water mark (room for a full replay twice,
  as vLLM sizes it) ZeroMQ drops them and the subscriber sees the gap;
- at most ``REPLAYS_PER_S`` requests are served a second (a burst of ``REPLAY_BURST``): past it a
  request gets only the end marker, so a client asking in a loop costs bounded work.
The socket is served by its own thread (ZeroMQ sockets are not shared between threads); the engine
thread only appends to the buffer, under a lock held for an append.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from kvfleet.token_bucket import TokenBucket

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAYS_PER_S = 10.0
REPLAY_BURST = 20.0
POLL_MS = 100  # how soon the thread sees close()


class ReplayBuffer:
    """The last ``steps`` batches ``(sequence, payload)``, appended by the engine thread."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._batches: deque[tuple[int, bytes]] = deque(maxlen=steps)
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._batches.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        with self._lock:
            batches = list(self._batches)
        if batches and start > batches[0][0]:
            # Numbers are consecutive in the buffer: skip straight to the start.
            return batches[min(start - batches[0][0], len(batches)) :]
        return batches


class ReplayServer:
    """Serves ``buffer`` on a bound ROUTER socket from a daemon thread until ``close``."""

    def __init__(self, endpoint: str, buffer: ReplayBuffer, topic: bytes) -> None:
        self.buffer = buffer
        self._topic = topic
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.SNDHWM, 2 * (buffer.steps + 1))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone client raises, so the replay stops
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(0)
            raise ValueError(f"kv_events_config.replay_endpoint: cannot bind {endpoint}: {e}") from e
        self.endpoint: str = str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT)) or endpoint
        self.served = 0
        self.refused = 0
        self._bucket = TokenBucket(REPLAYS_PER_S, REPLAY_BURST)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-events-replay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_MS):
                    self._answer(self._socket.recv_multipart())
        except zmq.ZMQError as e:  # the context is going away: nothing left to serve
            log.warning("kv events replay on %s stopped: %s", self.endpoint, e)
        finally:
            self._socket.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER prefixes the client's identity; REQ and DEALER clients send an empty delimiter first.
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("kv events replay: malformed request of %d frames; ignored", len(frames))
            self.refused += 1
            return
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        if self._bucket.take():
            for seq, payload in self.buffer.since(max(start, 0)):
                if not self._send((client, b"", self._topic, seq.to_bytes(8, "big"), payload)):
                    break  # the client's pipe is full: it sees the gap
            self.served += 1
        else:
            self.refused += 1
        self._send((client, b"", b"", END_SEQ, b""))

    def _send(self, frames: tuple[bytes, ...]) -> bool:
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN: the client's pipe is full; EHOSTUNREACH: it is gone
            return False
        return True
