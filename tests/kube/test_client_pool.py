"""``KubeClient`` keeps every connection of its pool alive between bursts (docs/contracts.md,
Kubernetes access): httpx keeps 20 by default, so a second burst of 40 requests in flight opened 20
new connections (a TLS handshake each, on both ends, against a real API server)."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.kube import KubeClient
from kvfleet.kube.client import env_proxy

BURST = 40


class CountingServer:
    """HTTP/1.1 with keep-alive over raw asyncio: counts the connections opened, and answers each
    burst only once all of it has arrived (so the client must hold ``BURST`` connections at once)."""

    def __init__(self) -> None:
        self.connections = 0
        self.waiting: list[asyncio.Future[None]] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                arrived = asyncio.get_running_loop().create_future()
                self.waiting.append(arrived)
                if len(self.waiting) == BURST:
                    for f in self.waiting:
                        f.set_result(None)
                    self.waiting = []
                await arrived
                body = b'{"kind": "Status"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_second_burst_reuses_every_connection() -> None:
    server = CountingServer()
    async with server as url, KubeClient.for_server(url, timeout_s=10) as client:
        for _ in range(2):
            await asyncio.wait_for(asyncio.gather(*(client.get("/api") for _ in range(BURST))), 10)
            await asyncio.sleep(0.2)
    assert server.connections == BURST


def test_the_pool_bound_is_checked() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        KubeClient.for_server("http://127.0.0.1:1", max_connections=0)


def test_the_proxy_comes_from_the_environment_unless_no_proxy_covers_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Looked up once per client (aiohttp's trust_env would read it, and ~/.netrc, on every request).
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert env_proxy("https://10.0.0.1:6443") == (None, None)
    monkeypatch.setenv("HTTPS_PROXY", "http://user:secret@proxy.internal:3128")
    proxy, auth = env_proxy("https://10.0.0.1:6443")
    assert str(proxy) == "http://proxy.internal:3128" and auth is not None and auth.login == "user"
    assert env_proxy("http://10.0.0.1:8080") == (None, None)  # no HTTP_PROXY for a plain-HTTP server
    monkeypatch.setenv("NO_PROXY", "10.0.0.1,.svc")
    assert env_proxy("https://10.0.0.1:6443") == (None, None)
    assert env_proxy("https://kubernetes.default.svc:443") == (None, None)
