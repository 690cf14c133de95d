"""A loopback TCP proxy in front of a real server that injects the network faults a healthy server
never produces on demand: a connection reset in the middle of a response body, a stall (bytes stop
flowing, the connection stays open), or an HTTP 503 SlowDown answered in the server's place.

The faults apply to the next N connections (``arm``); other connections are forwarded untouched.
A thread per direction per connection: the tests drive a few connections at a time."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal

Fault = Literal["reset", "stall", "slowdown"]

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)

# struct linger {l_onoff=1, l_linger=0}: close() sends RST instead of FIN.
_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclass
class _Plan:
    fault: Fault
    connections: int  # how many more new connections get the fault
    after_bytes: int  # reset/stall once this many response bytes went through
    stall_s: float


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``target``; ``arm`` schedules faults on new connections."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._plan: _Plan | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self.faults_injected = 0
        self.connections = 0
        # Response bytes left before every connection is reset (None: no budget).
        self._budget: int | None = None
        # Response bytes per second per connection (None: as fast as the server sends).
        self._rate: float | None = None
        self._thread = threading.Thread(target=self._accept, daemon=True, name="fault-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, fault: Fault, *, connections: int, after_bytes: int = 256 * 1024, stall_s: float = 30.0) -> None:
        with self._lock:
            self._plan = _Plan(fault, connections, after_bytes, stall_s)

    def arm_budget(self, response_bytes: int) -> None:
        """Forward ``response_bytes`` more response bytes over all connections together, then reset
        every connection, old and new, until ``disarm``: a server that goes away mid-pull."""
        with self._lock:
            self._budget = response_bytes

    def slow_down(self, bytes_per_s: float) -> None:
        """Forward at most ``bytes_per_s`` response bytes per second on each connection until
        ``disarm``: a slow link, so a pull of even a small model runs for as long as a test needs."""
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        with self._lock:
            self._rate = bytes_per_s

    def disarm(self) -> None:
        with self._lock:
            self._plan = None
            self._budget = None
            self._rate = None

    def _spend(self, n: int) -> int:
        """How many of ``n`` response bytes the budget lets through."""
        with self._lock:
            if self._budget is None:
                return n
            allowed = min(n, self._budget)
            self._budget -= allowed
            if allowed < n:
                self.faults_injected += 1
            return allowed

    def _take_fault(self) -> _Plan | None:
        with self._lock:
            plan = self._plan
            if plan is None or plan.connections <= 0:
                return None
            plan.connections -= 1
            self.faults_injected += 1
            return _Plan(plan.fault, 1, plan.after_bytes, plan.stall_s)

    def _accept(self) -> None:
        self._listener.settimeout(0.2)  # wakes to notice close(); a blocked accept() would not
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self.connections += 1
            plan = self._take_fault()
            threading.Thread(target=self._serve, args=(client, plan), daemon=True).start()

    def _serve(self, client: socket.socket, plan: _Plan | None) -> None:
        self._sockets.append(client)
        if plan is not None and plan.fault == "slowdown":
            client.recv(65536)  # the request head; the server never sees it
            client.sendall(
                b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                + f"Content-Length: {len(SLOWDOWN_BODY)}\r\n\r\n".encode()
                + SLOWDOWN_BODY
            )
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        self._sockets.append(upstream)
        threading.Thread(target=self._pump, args=(client, upstream, None, False), daemon=True).start()
        self._pump(upstream, client, plan, True)

    def _pump(self, src: socket.socket, dst: socket.socket, plan: _Plan | None, response: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if response and (allowed := self._spend(len(data))) < len(data):
                    dst.sendall(data[:allowed])
                    self._reset(dst)
                    break
                if plan is not None and sent + len(data) > plan.after_bytes:
                    dst.sendall(data[: max(0, plan.after_bytes - sent)])
                    if plan.fault == "stall":
                        # Hold the connection open, send nothing more: the client's read timeout fires.
                        self._closing.wait(plan.stall_s)
                    # A reset: RST (SO_LINGER 0), not a clean FIN, as a crashed peer or a middlebox sends.
                    self._reset(dst)
                    break
                if response and (rate := self._rate) is not None:
                    self._closing.wait(len(data) / rate)  # close() wakes it
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with suppress(OSError):
                    sock.close()

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        """RST the client's connection. The other direction's thread is blocked reading this socket
        and a close() from here would not wake it (nor send anything) until it returns: shutting
        down the read side wakes it, and the last close, with linger 0, sends the RST."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        self._listener.close()
        for sock in self._sockets:
            with suppress(OSError):
                sock.close()


@contextmanager
def fault_proxy(endpoint_url: str) -> Iterator[FaultProxy]:
    """A ``FaultProxy`` in front of ``endpoint_url`` (http://host:port), closed on the way out."""
    host, port = endpoint_url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    proxy = FaultProxy(host, int(port))
    try:
        yield proxy
    finally:
        proxy.close()
