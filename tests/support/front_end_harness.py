"""Drive the router's HTTP front end (the router/http_server/ package) in memory, for the fuzz target and the
differential test against h11.

The connection protocol is fed bytes directly and writes into a memory transport: a fuzzer needs
thousands of inputs a second, which real sockets cannot give. Everything between the bytes and the
handler is the product's own code; only the socket is replaced.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import h11

from kvfleet.router.http_server import HttpRequest, HttpServer, HttpServerSettings, Responder
from kvfleet.router.http_server.connection import ClientConnection

SETTINGS = HttpServerSettings(
    max_body_bytes=4096,
    keepalive_timeout_s=30.0,
    shutdown_timeout_s=1.0,
    max_head_bytes=8192,
    max_headers=50,
)


class MemoryTransport(asyncio.Transport):
    """What the server writes, and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing:
            self.out += data

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


@dataclass
class Served:
    requests: list[HttpRequest] = field(default_factory=list)
    output: bytes = b""
    closed: bool = False


def serve_bytes(pieces: list[bytes], settings: HttpServerSettings = SETTINGS) -> Served:
    """Feed ``pieces`` (one read each) to a fresh connection; the handler answers 200 with the body's size."""
    served = Served()

    async def handler(request: HttpRequest, responder: Responder) -> None:
        served.requests.append(request)
        responder.send(200, [("Content-Type", "text/plain")], str(len(request.body)).encode())

    loop = asyncio.new_event_loop()
    try:
        server = HttpServer(handler, settings)
        server.loop = loop
        transport = MemoryTransport()
        conn = ClientConnection(server)
        conn.connection_made(transport)
        for piece in pieces:
            if transport.closing:
                break
            conn.data_received(piece)
            loop.run_until_complete(asyncio.sleep(0))
        for _ in range(3):  # let queued pipelined requests be answered
            loop.run_until_complete(asyncio.sleep(0))
        conn.connection_lost(None)
        served.output = bytes(transport.out)
        served.closed = transport.closing
    finally:
        loop.close()
    return served


def check_responses(output: bytes) -> list[int]:
    """Parse what the server wrote with h11 as a client would; raises if it is not well-formed HTTP/1.1."""
    client = h11.Connection(h11.CLIENT)
    statuses: list[int] = []
    data = output
    while True:
        # h11 needs a request sent before it reads a response; a dummy one per response.
        if client.our_state is h11.IDLE:
            client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
            client.send(h11.EndOfMessage())
        if data:
            client.receive_data(data)
            data = b""
        event = client.next_event()
        if event is h11.NEED_DATA:
            if client.their_state is h11.SEND_BODY or client.trailing_data[0]:
                raise AssertionError(f"response cut short: {output[-200:]!r}")
            return statuses
        if isinstance(event, h11.Response):
            statuses.append(event.status_code)
        elif isinstance(event, h11.EndOfMessage):
            if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
                return statuses
            client.start_next_cycle()
        elif isinstance(event, h11.ConnectionClosed):
            return statuses


# -- the differential test: one request, read by both parsers --------------------------------------------


@dataclass(frozen=True)
class Reading:
    """How a parser read the first request: ``ok`` with its parts, ``error``, or ``incomplete``."""

    outcome: str
    method: str = ""
    target: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


def read_with_h11(raw: bytes) -> Reading:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=SETTINGS.max_head_bytes)
    try:
        conn.receive_data(raw)
        request: h11.Request | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return Reading("incomplete")
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                headers = tuple(_normal(n.decode("latin-1"), v.decode("latin-1")) for n, v in request.headers)
                return Reading("ok", request.method.decode("latin-1"), request.target.decode("latin-1"), headers, body)
    except h11.RemoteProtocolError:
        return Reading("error")


def _normal(name: str, value: str) -> tuple[str, str]:
    # h11 lowercases the values of the headers it interprets (its own normalisation, not a reading).
    return name, value.lower() if name in ("transfer-encoding", "connection", "expect") else value


def read_with_router(raw: bytes) -> Reading:
    served = serve_bytes([raw])
    if served.requests:
        r = served.requests[0]
        # llhttp keeps names and values as sent; h11 lowercases names and strips surrounding whitespace.
        raw_headers = r.raw_headers
        headers = tuple(_normal(n.decode("latin-1").lower(), v.decode("latin-1").strip(" \t")) for n, v in raw_headers)
        return Reading("ok", r.method, r.path_qs, headers, r.body)
    if served.output:
        return Reading("error")
    return Reading("incomplete")


_METHODS = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "X-CUSTOM", "get", "G ET", "GET\t", ""]
_TARGETS = ["/", "/v1/completions", "/a?b=c&d", "/%41%20", "/a b", "/\x7f", "//x", "/a#frag", "/é", "?x", "/a?"]
_VERSIONS = ["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.2", "http/1.1", "HTTP/1.1 ", "HTTP/11"]
_PLAIN = [
    "X-Name: value",
    "X-Tab: a\tb",
    "X-Empty:",
    "X-Spaces:   padded   ",
    "Connection: close",
    "Connection: keep-alive",
    "Accept: */*",
    "X-Colon:: x",
    "X-High: caf\xe9",
]
_ODD = [
    "Bad Name: x",
    "X@: 1",
    "NoColon",
    " Leading: space",
    "X-Fold: a\r\n  continued",
    "X-Ctl: a\x01b",
    "X-Del: a\x7fb",
    "X-Name : spaced",
    "Host: second",
]


def _chunked(body: bytes, rng: random.Random) -> bytes:
    out = b""
    rest = body
    while rest:
        n = rng.randint(1, max(1, len(rest)))
        size = f"{n:x}".upper() if rng.random() < 0.2 else f"{n:x}"
        ext = ";a=b" if rng.random() < 0.1 else ""
        out += f"{size}{ext}\r\n".encode() + rest[:n] + b"\r\n"
        rest = rest[n:]
    trailer = b"X-Trailer: 1\r\n" if rng.random() < 0.1 else b""
    return out + b"0\r\n" + trailer + b"\r\n"


def generate_request(rng: random.Random) -> bytes:
    """One HTTP/1.x request, mostly valid, with the odd corner that parsers disagree on."""
    eol = "\r\n" if rng.random() < 0.93 else "\n"
    method = rng.choice(_METHODS) if rng.random() < 0.2 else rng.choice(["GET", "POST"])
    target = rng.choice(_TARGETS) if rng.random() < 0.3 else rng.choice(["/", "/v1/completions", "/a?b=c&d"])
    version = rng.choice(_VERSIONS) if rng.random() < 0.3 else "HTTP/1.1"
    lines = [f"{method} {target} {version}"]
    if rng.random() < 0.9:
        lines.append("Host: example")
    lines += rng.sample(_PLAIN, k=rng.randint(0, 3))
    if rng.random() < 0.25:
        lines.append(rng.choice(_ODD))
    body = bytes(rng.choice(b"abc{}\r\n") for _ in range(rng.randint(0, 40)))
    framing = rng.random()
    wire_body = b""
    if framing < 0.35:
        lines.append(f"Content-Length: {len(body)}")
        wire_body = body
    elif framing < 0.55:
        lines.append(rng.choice(["Transfer-Encoding: chunked"] * 4 + ["Transfer-Encoding: Chunked"]))
        wire_body = _chunked(body, rng)
    elif framing < 0.62:
        lines.append(f"Content-Length: {len(body)}")
        lines.append(f"Content-Length: {rng.choice([len(body), len(body) + 1])}")
        wire_body = body
    elif framing < 0.68:
        lines.append(f"Content-Length: {len(body)}")
        lines.append("Transfer-Encoding: chunked")
        wire_body = _chunked(body, rng)
    elif framing < 0.74:
        odd_lengths = [f"+{len(body)}", f"{len(body)} ", "0x5", f"{len(body)},{len(body)}", "-1"]
        lines.append("Content-Length: " + rng.choice(odd_lengths))
        wire_body = body
    elif framing < 0.78:
        odd_codings = ["gzip, chunked", "chunked, gzip", "identity", "chunked\x0b", "chunked, chunked"]
        lines.append("Transfer-Encoding: " + rng.choice(odd_codings))
        wire_body = _chunked(body, rng)
    head = eol.join(lines) + eol + eol
    return head.encode("latin-1") + wire_body
