"""The router's HTTP/1.1 server: asyncio protocols with ``httptools`` (llhttp) parsing requests.

Hand-written instead of aiohttp's server for CPU per request: the router spent ~70 us of its ~130 us
per proxied request in aiohttp's request, response and writer objects (measured with py-spy under
wrk; see docs/benchmarks/router.md), and a request through this server costs ~10 us. It does what a
proxy's front end needs and no more:

- keep-alive, HTTP/1.0 and 1.1, pipelined requests answered in order (reading pauses past a bound);
- request bodies (``Content-Length`` or chunked) up to ``max_body_bytes``; a larger one is read and
  dropped (up to a bound, then the connection is closed) and answered by the handler's 413;
  ``Expect: 100-continue`` is answered;
- whole responses in one write, or streamed ones (chunked framing) with flow control;
- a client that goes away cancels its handler, so the upstream request is cancelled too;
- idle connections closed after ``keepalive_timeout_s``; a malformed request gets 400 and a close;
- bounds against hostile clients (nginx-like defaults, see ``HttpServerSettings``): a request head over
  ``max_head_bytes`` or with more than ``max_headers`` header fields gets 431 and a close; a head not
  complete ``head_timeout_s`` after its first byte gets 408 and a close (slowloris); connections past
  ``max_connections`` in total or ``max_connections_per_client`` from one address are answered 503 and
  closed at once, before anything is read;
- ``close`` stops listening, lets in-flight requests finish for a grace period, then cancels them.

The application is one ``Handler``: ``async (HttpRequest, Responder) -> None``.

The modules, from what a handler sees down to the socket:

- ``messages``: ``HttpRequest`` (one parsed request) and ``Responder`` (writes its answer, whole or
  streamed), the ``Handler`` type;
- ``connection``: ``ClientConnection``, one client connection's protocol: llhttp's callbacks, the
  head and body bounds, refusals with a lingering close, pipelined requests served in order;
- ``listener``: ``HttpServer``, which listens, admits or refuses connections, sweeps idle ones and
  slow heads with one timer, and stops gracefully;
- ``bounds``: ``HttpServerSettings`` and the fixed bounds, in one place.

The names a caller needs are importable from here.
"""

from kvfleet.router.http_server.bounds import HttpServerSettings
from kvfleet.router.http_server.listener import HttpServer
from kvfleet.router.http_server.messages import Handler, Headers, HttpRequest, Responder

__all__ = ["Handler", "Headers", "HttpRequest", "HttpServer", "HttpServerSettings", "Responder"]
