"""The router's HTTP/1.1 client to replicas: a bounded keep-alive pool per replica origin.

Hand-written on asyncio protocols with ``httptools`` (llhttp) parsing the responses, instead of
``aiohttp.ClientSession``: a proxied request through aiohttp's client cost ~140 us of CPU (request
and payload objects, header merging, timers, tasks), over half of the router's per-request cost.
This does only what a proxy needs: one write of the request, the response head, then the body as
it arrives (chunked framing decoded), with flow control, an idle read timeout, and connections
returned to the pool only after a complete response.

Errors (all ``UpstreamIOError``), by how a request fails: ``UpstreamPoolTimeoutError`` (no pooled
connection came free within ``pool_wait_timeout_s``: nothing was sent), ``UpstreamConnectError``
(nothing was sent; ``UpstreamConnectTimeoutError`` when ``connect_timeout_s`` ran out),
``UpstreamClosedError`` (the connection broke), ``UpstreamTimeoutError`` (the replica went silent for
``read_timeout_s``). ``is_timeout`` marks the three that are a wait running out. The router maps them
to its answers in one place (``kvfleet.router.forward.upstream_failure``).

An ``UpstreamResponse`` is a context manager: leaving its block gives the connection back to the pool
when the block ended normally (``release``) and closes it when it raised (``close``).

The modules, from the contract a caller relies on down to the socket:

- ``errors``: the error tree above;
- ``pool``: ``UpstreamPool`` and ``PoolSettings``: which connection a request goes on, the wait for
  one when all are in use, keep-alive expiry, and the one sweep that enforces read timeouts;
- ``response``: ``UpstreamResponse``, the answer as the parser delivers it, with flow control;
- ``connection``: ``ReplicaConnection``, one keep-alive connection's protocol, and ``OriginPool``,
  the per-origin bookkeeping (idle connections, open count, waiters) it shares with the pool.

The three share state a caller never touches (a response puts its connection back in the pool and
is watched by the pool's deadline sweep; a connection that closes updates its origin's count): those
methods and attributes have plain names so the modules can call them, and are this package's own,
not part of its interface. The names a caller needs are importable from here.
"""

from kvfleet.router.upstream.errors import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamConnectTimeoutError,
    UpstreamIOError,
    UpstreamPoolTimeoutError,
    UpstreamTimeoutError,
)
from kvfleet.router.upstream.pool import PoolSettings, UpstreamPool
from kvfleet.router.upstream.response import HIGH_WATER_BYTES, UpstreamResponse

__all__ = [
    "HIGH_WATER_BYTES",
    "PoolSettings",
    "UpstreamClosedError",
    "UpstreamConnectError",
    "UpstreamConnectTimeoutError",
    "UpstreamIOError",
    "UpstreamPool",
    "UpstreamPoolTimeoutError",
    "UpstreamResponse",
    "UpstreamTimeoutError",
]
