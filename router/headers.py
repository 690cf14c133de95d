"""Which headers pass through the router, each way: end-to-end ones as the other side sent them, minus the
per-connection (hop-by-hop) ones and those the router's server writes itself; X-Forwarded-For extended
with the client's address, and X-Kvfleet-Replica naming the replica that answered."""

from __future__ import annotations

from kvfleet.router.http_server import HttpRequest
from kvfleet.router.upstream import UpstreamResponse

# Per-connection headers (RFC 9110 7.6.1) and the ones the router's server writes itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "server",
        "date",
    }
)
# Not forwarded upstream either: the router's server answers ``Expect: 100-continue`` itself, and the
# request it sends is complete.
_NOT_FORWARDED = _HOP_BY_HOP | {"expect"}
_HOP_BY_HOP_RAW = frozenset(name.encode() for name in _HOP_BY_HOP)
_NOT_FORWARDED_RAW = frozenset(name.encode() for name in _NOT_FORWARDED | {"x-forwarded-for"})


def response_header_lines(upstream: UpstreamResponse, replica_id: str) -> bytes:
    """The replica's end-to-end headers as sent (llhttp has checked them), and which replica answered."""
    lines = [
        name + b": " + value + b"\r\n" for name, value in upstream.raw_headers if name.lower() not in _HOP_BY_HOP_RAW
    ]
    lines.append(b"X-Kvfleet-Replica: " + replica_id.encode("latin-1") + b"\r\n")
    return b"".join(lines)


def forward_headers(request: HttpRequest) -> bytes:
    """The client's end-to-end headers as ``Name: value\r\n`` lines, with X-Forwarded-For extended."""
    lines: list[bytes] = []
    prior = b""
    for name, value in request.raw_headers:
        lower = name.lower()
        if lower == b"x-forwarded-for":
            prior = value if not prior else prior + b", " + value
        elif lower not in _NOT_FORWARDED_RAW:
            lines.append(name + b": " + value + b"\r\n")
    peer = request.remote.encode("latin-1")
    lines.append(b"X-Forwarded-For: " + (prior + b", " + peer if prior else peer) + b"\r\n")
    return b"".join(lines)
