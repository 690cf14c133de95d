"""Host loopback ports into the real node's network namespace.

Pods, Services and the control plane (which runs inside the namespace with the node) are reachable
only there. This process listens on the host's 127.0.0.1 and, per connection, opens a socket
inside the namespace (a socket belongs to the namespace its creator was in: setns(2) around
socket(2)) and copies bytes both ways. A target is ``ADDR:PORT`` inside the namespace, or
``service:NAMESPACE/NAME:PORT``, looked up through the API server on each connection (cached for a
few seconds), so a Service installed later (the chart's router) is reachable at a port printed at
``up``.

The other way, ``--into ADDR:PORT=HOSTADDR:HOSTPORT`` listens inside the namespace (e.g. on the node
address) and connects on the host: pods reach a server that runs on the host's loopback (an S3
server in the tests) as they would reach one in their datacenter.

Run: ``python -m kvfleet.devcluster.realnode.forward --netns /proc/PID/ns/net --ca CA --cert CRT
--key KEY --server URL PORT=TARGET ... [--into ADDR:PORT=HOSTADDR:HOSTPORT ...]``. Bounds:
connections, connect timeout, lookup cache age.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import socket
import time
from dataclasses import dataclass

from ..admin import AdminApi
from ..pki import Pki

CLONE_NEWNET = 0x40000000
MAX_CONNECTIONS = 512  # a dev cluster's kubectl, helm and test clients; past this new ones wait
CONNECT_TIMEOUT_S = 5.0
SERVICE_CACHE_S = 5.0  # a Service's ClusterIP never changes; a deleted and remade one does
BUFFER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Route:
    host_port: int
    target: str  # "ADDR:PORT" or "service:NS/NAME:PORT"

    @classmethod
    def parse(cls, text: str) -> Route:
        port, sep, target = text.partition("=")
        if not sep or not port.isdigit() or ":" not in target:
            raise ValueError(f"route must be HOSTPORT=ADDR:PORT or HOSTPORT=service:NS/NAME:PORT, got {text!r}")
        return cls(int(port), target)


@dataclass(frozen=True)
class IntoRoute:
    listen: tuple[str, int]  # inside the namespace
    target: tuple[str, int]  # on the host

    @classmethod
    def parse(cls, text: str) -> IntoRoute:
        listen, sep, target = text.partition("=")
        try:
            if not sep:
                raise ValueError
            (la, _, lp), (ta, _, tp) = listen.rpartition(":"), target.rpartition(":")
            return cls((la, int(lp)), (ta, int(tp)))
        except ValueError:
            raise ValueError(f"an --into route must be ADDR:PORT=HOSTADDR:HOSTPORT, got {text!r}") from None


class NetnsSockets:
    """Creates TCP sockets inside another network namespace (setns(2) there and back, on this thread)."""

    def __init__(self, netns_path: str) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._target = os.open(netns_path, os.O_RDONLY)
        self._home = os.open(f"/proc/{os.getpid()}/task/{os.getpid()}/ns/net", os.O_RDONLY)

    def _setns(self, fd: int) -> None:
        if self._libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")

    def tcp_socket(self) -> socket.socket:
        self._setns(self._target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            self._setns(self._home)
        sock.setblocking(False)
        return sock

    def tcp_listener(self, addr: tuple[str, int]) -> socket.socket:
        """A listening socket inside the namespace (it stays there after this thread goes home)."""
        self._setns(self._target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            self._setns(self._home)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
        return sock


class Resolver:
    def __init__(self, api: AdminApi | None) -> None:
        self._api = api
        self._cache: dict[str, tuple[float, tuple[str, int]]] = {}

    def resolve(self, target: str) -> tuple[str, int]:
        if not target.startswith("service:"):
            addr, _, port = target.rpartition(":")
            return addr, int(port)
        hit = self._cache.get(target)
        if hit and time.monotonic() - hit[0] < SERVICE_CACHE_S:
            return hit[1]
        if self._api is None:
            raise OSError(f"{target}: no API credentials to look the Service up")
        ref, _, port = target.removeprefix("service:").rpartition(":")
        namespace, _, name = ref.partition("/")
        status, body = self._api.call("GET", f"/api/v1/namespaces/{namespace}/services/{name}", timeout_s=3)
        if status != 200:
            raise OSError(f"Service {namespace}/{name}: {status}")
        cluster_ip = body["spec"].get("clusterIP")
        if not cluster_ip or cluster_ip == "None":
            raise OSError(f"Service {namespace}/{name} has no ClusterIP")
        result = (cluster_ip, int(port))
        self._cache[target] = (time.monotonic(), result)
        return result


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(BUFFER_BYTES):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


class Forwarder:
    def __init__(self, sockets: NetnsSockets, resolver: Resolver) -> None:
        self.sockets = sockets
        self._resolver = resolver
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def handle(self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self._slots:
            loop = asyncio.get_running_loop()
            try:
                addr = await loop.run_in_executor(None, self._resolver.resolve, route.target)
                sock = self.sockets.tcp_socket()
                await asyncio.wait_for(loop.sock_connect(sock, addr), CONNECT_TIMEOUT_S)
                up_reader, up_writer = await asyncio.open_connection(sock=sock)
            except (OSError, TimeoutError, KeyError, ValueError):
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            for w in (writer, up_writer):
                w.close()

    async def handle_into(self, route: IntoRoute, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self._slots:
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*route.target), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            for w in (writer, up_writer):
                w.close()


async def serve(routes: list[Route], forwarder: Forwarder, into: list[IntoRoute] | None = None) -> None:
    servers = []
    for into_route in into or []:

        async def on_into(r: asyncio.StreamReader, w: asyncio.StreamWriter, route: IntoRoute = into_route) -> None:
            await forwarder.handle_into(route, r, w)

        listener = forwarder.sockets.tcp_listener(into_route.listen)
        servers.append(await asyncio.start_server(on_into, sock=listener))
    for route in routes:

        async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter, route: Route = route) -> None:
            await forwarder.handle(route, r, w)

        servers.append(await asyncio.start_server(on_connect, "127.0.0.1", route.host_port, reuse_address=True))
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--netns", required=True)
    parser.add_argument("--server")
    parser.add_argument("--ca")
    parser.add_argument("--cert")
    parser.add_argument("--key")
    parser.add_argument("routes", nargs="*", type=Route.parse)
    parser.add_argument("--into", action="append", type=IntoRoute.parse, default=[])
    args = parser.parse_args(argv)
    api = None
    if args.server:
        from pathlib import Path

        pki = Pki(
            ca_cert=Path(args.ca),
            ca_key=Path(),
            serving_cert=Path(),
            serving_key=Path(),
            admin_cert=Path(args.cert),
            admin_key=Path(args.key),
            sa_key=Path(),
            sa_pub=Path(),
        )
        # The API server is itself behind this forwarder: the lookups go to its host port.
        api = AdminApi(args.server, pki)
    if not args.routes and not args.into:
        parser.error("no route: give PORT=TARGET or --into ADDR:PORT=HOSTADDR:HOSTPORT")
    asyncio.run(serve(args.routes, Forwarder(NetnsSockets(args.netns), Resolver(api)), args.into))


if __name__ == "__main__":
    main()
