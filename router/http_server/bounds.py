"""The front end's bounds: the settings a deployment tunes and the fixed ones, read together.

Kept apart from the protocol so the limits a hostile client runs into (docs/router.md, "The front
end's bounds") are one short page, not scattered through the parser's callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass

# Complete requests queued on one connection before reading from it pauses (pipelining bound).
MAX_PIPELINED = 16
# How long a refused connection's further input is read and dropped before it is closed.
LINGER_S = 1.0
# Bytes of an over-limit body read and dropped before the connection is closed instead.
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class HttpServerSettings:
    """The front end's bounds. The defaults follow nginx: 4 x 8 KiB header buffers (32 KiB of head),
    ``client_header_timeout 60s``; 100 header fields is Apache's ``LimitRequestFields``."""

    max_body_bytes: int
    keepalive_timeout_s: float
    shutdown_timeout_s: float
    # Request line plus header fields, as received: llhttp buffers an unfinished header whole, so this
    # is what bounds the memory a client can make a connection hold before its request is complete.
    max_head_bytes: int = 32 * 1024
    max_headers: int = 100
    # From a head's first byte to its end: a client dripping a head byte by byte is cut off (slowloris).
    head_timeout_s: float = 60.0
    max_connections: int = 8192
    max_connections_per_client: int = 1024
