"""``KubeClient``: one kept HTTP connection pool to the API server; the one client of the operator,
the router and the autoscaler.

lightkube does what must not be hand-written: kubeconfig contexts and in-cluster service accounts,
bearer tokens, ``tokenFile`` (re-read on a 401, so rotated service-account tokens are picked up),
exec plugins, client certificates and TLS verification (``credentials.py`` drives its auth flow).
aiohttp carries the requests: the library kopf itself talks to the API server with. This module
adds only paths, JSON in and out, the verbs the components use, and the mapping of every failure
onto ``kvfleet.kube.errors`` (once, here): the status code, the API server's reason and message and
its ``Retry-After`` travel in the ``KubeError``.

Why aiohttp and not lightkube's own httpx client: httpx spent ~3.7 ms of client CPU on each
server-side apply where aiohttp spends ~0.6 ms (bench/kube_transport.py; httpx's pool checks every
kept connection, a system call each, on every request and every response), and at 1,000
deployments the operator sends ~10,000 requests in an apply, on the same cores as the API server it
waits for (docs/benchmarks/scale.md).

Why requests by path rather than lightkube's typed ``get``/``watch``: every component reads and
writes objects as plain JSON (pydantic validates the spec; the operator renders its children as
dicts and server-side applies them), and lightkube's ``watch`` cannot
ask for bookmarks (``allowWatchBookmarks``), retries without back-off, and reports an HTTP-level
410 or 429 as a bare ``HTTPStatusError``; ``kvfleet.kube.watch`` does those over ``stream_events``.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import yarl
from aiohttp.helpers import get_env_proxy_for_url
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError

from kvfleet.kube.backoff import parse_retry_after
from kvfleet.kube.config import load_config, server_config
from kvfleet.kube.credentials import UNAUTHORIZED, Credentials
from kvfleet.kube.errors import KubeError, KubeNotFound, KubeUnavailable, KubeUnreachable, error_for
from kvfleet.kube.ref import Ref, group_path

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML, so the body is JSON
KEEPALIVE_S = 30.0  # an idle connection is closed after this (aiohttp: 15 s, a reconnect after a lull)
ERROR_BODY_BYTES = 4096  # of an error answer, read for its message
# What a request fails with when no answer came (timeouts are OSError, TLS errors too).
NO_ANSWER = (aiohttp.ClientError, ConfigError, OSError)
# ... and when not even a connection was made.
NO_CONNECTION = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


class KubeClient:
    """JSON in, JSON out, over one kept connection pool; errors mapped once, here."""

    def __init__(
        self,
        config: SingleConfig,
        *,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        max_event_bytes: int = 2**21,
        user_agent: str = "kvfleet",
        max_connections: int = 64,
    ) -> None:
        """``max_connections``: the pool's bound, watches included; every connection is kept alive
        (a pool that keeps fewer, as httpx's 20 did, closed and reopened connections all through the
        operator's bursts of ~50 requests in flight in an apply of 1,000 deployments, a TLS
        handshake each on both ends); a request beyond the bound waits for a free connection."""
        if not 0 < timeout_s <= 600:
            raise ValueError(f"timeout_s must be in (0, 600], got {timeout_s}")
        if not 0 < connect_timeout_s <= 300:
            raise ValueError(f"connect_timeout_s must be in (0, 300], got {connect_timeout_s}")
        if not 2**12 <= max_event_bytes <= 2**26:
            raise ValueError("max_event_bytes must be in [4 KiB, 64 MiB]")
        if not 1 <= max_connections <= 1024:
            raise ValueError(f"max_connections must be in [1, 1024], got {max_connections}")
        self.max_connections = max_connections
        self.config = config
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_event_bytes = max_event_bytes
        self._user_agent = user_agent
        self._credentials = Credentials(config)
        self._http: aiohttp.ClientSession | None = None
        self._proxy: tuple[yarl.URL | None, aiohttp.BasicAuth | None] = (None, None)

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None, context: str | None = None, **kw: Any) -> KubeClient:
        return cls(load_config(kubeconfig, context), **kw)

    @classmethod
    def for_server(cls, url: str, **kw: Any) -> KubeClient:
        return cls(server_config(url), **kw)

    @property
    def server(self) -> str:
        return str(self.config.cluster.server).rstrip("/")

    def _timeout(self, read_s: float) -> aiohttp.ClientTimeout:
        """No bound on the whole request (a watch lasts minutes); each step has one: a free
        connection and a connection made within ``timeout_s``, a TCP/TLS connect within
        ``connect_timeout_s``, and no silence longer than ``read_s`` while the answer comes."""
        return aiohttp.ClientTimeout(
            total=None,
            connect=self.timeout_s,
            sock_connect=min(self.connect_timeout_s, self.timeout_s),
            sock_read=read_s,
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            try:
                # lightkube's TLS settings: the cluster's CA (or none, when insecure), the client certificate.
                tls: ssl.SSLContext | bool = False
                if self.server.startswith("https:"):
                    tls = (
                        verify_cluster(self.config.cluster, self.config.user, self.config.abs_file)
                        if self.config.user is not None
                        else ssl.create_default_context()
                    )
            except (ConfigError, OSError, ssl.SSLError) as e:
                raise KubeUnavailable(f"cannot set up a client for {self.server}: {e}") from e
            connector = aiohttp.TCPConnector(
                ssl=tls, limit=self.max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
            )
            # trust_env stays off: aiohttp would then read the environment and ~/.netrc in a thread
            # on every request (two thread hand-offs each); the proxy is looked up once instead.
            self._proxy = env_proxy(self.server)
            self._http = aiohttp.ClientSession(
                connector=connector,
                headers={"User-Agent": self._user_agent, "Accept": JSON},
                timeout=self._timeout(self.timeout_s),
            )
        return self._http

    async def _open(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None,
        content: bytes | None,
        headers: Mapping[str, str],
        read_s: float,
    ) -> aiohttp.ClientResponse:
        """The answer's head (its body still to read; the caller releases it), sent once more with
        renewed credentials after a 401 when the credentials can be renewed."""

        async def send(authorization: str | None) -> aiohttp.ClientResponse:
            return await self._client().request(
                method,
                self.server + path,
                params=dict(params or {}),
                data=content,
                headers={**headers, "Authorization": authorization} if authorization else dict(headers),
                timeout=self._timeout(read_s),
                proxy=self._proxy[0],
                proxy_auth=self._proxy[1],
            )

        header = await self._credentials.header()
        response = await send(header)
        if response.status == UNAUTHORIZED and header is not None:
            fresh = await self._credentials.refreshed(header)
            if fresh is not None:
                response.release()
                response = await send(fresh)
        return response

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        headers = {"Content-Type": content_type} if body is not None else {}
        content = json.dumps(body).encode() if body is not None else None
        where = f"{method} {path}"
        try:
            response = await self._open(
                method, path, params=params, content=content, headers=headers, read_s=self.timeout_s
            )
            async with response:
                raw = await response.read()
        except KubeError:
            raise
        except NO_ANSWER as e:
            raise KubeUnavailable(f"{where}: {type(e).__name__}: {e}") from e
        if response.status >= 400:
            text = raw[:ERROR_BODY_BYTES].decode(errors="replace")
            raise self._status_error(where, response.status, text, response.headers)
        try:
            result = json.loads(raw) if raw else {}
        except ValueError as e:
            raise KubeError(f"{where}: response is not JSON", response.status) from e
        if not isinstance(result, dict):
            raise KubeError(f"{where}: response is not a JSON object", response.status)
        return result

    @staticmethod
    def _status_error(where: str, status: int, text: str, headers: Mapping[str, str]) -> KubeError:
        message = f"{where}: HTTP {status}"
        reason = None
        try:
            payload = json.loads(text)
            detail = str(payload.get("message") or "")
            reason = str(payload.get("reason") or "") or None
        except (ValueError, AttributeError):
            detail = text[:200]
        if detail:
            message += f" {detail}"
        retry_after_s = parse_retry_after(headers.get("Retry-After"))
        return error_for(status, message, retry_after_s, reason=reason, detail=detail or message)

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        return await self.request("POST", path, body, params={"fieldManager": field_manager})

    async def merge_patch(self, path: str, body: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        return await self.request("PATCH", path, body, params={"fieldManager": field_manager}, content_type=MERGE_PATCH)

    # --- verbs by resource type (``Ref``): the operator's reconcile and the autoscaler's actuator

    async def get_object(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.get(ref.item(namespace, name))
        except KubeNotFound:
            return None

    async def list_objects(self, ref: Ref, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        result = await self.get(ref.collection(namespace), {"labelSelector": label_selector})
        return [item for item in result.get("items") or [] if isinstance(item, dict)]

    async def apply(self, ref: Ref, obj: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        """Server-side apply; ``force`` takes fields back from whoever edited them by hand."""
        meta = obj["metadata"]
        path = ref.item(meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true"}
        return await self.request("PATCH", path, obj, params=params, content_type=APPLY_PATCH)

    async def patch_status(
        self,
        ref: Ref,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        *,
        field_manager: str,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """A merge patch of ``status`` through the status subresource (never touches spec): only the
        keys in ``status`` change, so each writer sends only the fields it owns.

        ``resource_version``: written only if the object is still at that version (the API server
        answers 409, ``KubeConflict``, when it has moved on): a status planned from a copy that may
        be stale costs one request when it was not, instead of a read before every write."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.merge_patch(ref.item(namespace, name, "status"), body, field_manager=field_manager)

    async def delete_object(self, ref: Ref, namespace: str | None, name: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", ref.item(namespace, name), body)
        except KubeNotFound:
            return False
        return True

    async def serves(self, api_version: str, plural: str) -> bool:
        """Discovery: does the server serve this resource? (Needs no RBAC: discovery is public.)"""
        try:
            doc = await self.get(group_path(api_version))
        except KubeNotFound:
            return False
        return any(isinstance(r, dict) and r.get("name") == plural for r in doc.get("resources") or [])

    async def stream_events(self, path: str, params: Mapping[str, str], read_timeout_s: float) -> AsyncIterator[Any]:
        """One watch request: yields each event (a decoded JSON line) until the server ends the
        stream. Raises ``KubeError`` for an error status, a broken stream, or a line over
        ``max_event_bytes`` (a bound on what one event may cost in memory)."""
        where = f"watch {path}"
        try:
            response = await self._open("GET", path, params=params, content=None, headers={}, read_s=read_timeout_s)
            async with response:
                if response.status != 200:
                    text = (await _head(response, ERROR_BODY_BYTES)).decode(errors="replace")
                    raise self._status_error(where, response.status, text, response.headers)
                async for event in json_lines(response.content.iter_any(), self.max_event_bytes, where):
                    yield event
        except KubeError:
            raise
        except ValueError as e:
            raise KubeError(f"{where}: an event that is not JSON: {e}") from e
        except NO_CONNECTION as e:
            raise KubeUnreachable(f"{where}: {type(e).__name__}: {e}") from e
        except NO_ANSWER as e:
            raise KubeUnavailable(f"{where}: {type(e).__name__}: {e}") from e


async def _head(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """Up to ``limit`` bytes of an answer's body (an error's message; the rest is not read)."""
    head = bytearray()
    while len(head) < limit and (chunk := await response.content.read(limit - len(head))):
        head += chunk
    return bytes(head)


def env_proxy(server: str) -> tuple[yarl.URL | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for the API server (``HTTPS_PROXY`` or ``HTTP_PROXY`` by the
    server's scheme, unless ``NO_PROXY`` covers its host), as lightkube's client honoured them;
    aiohttp's own lookup, run once."""
    try:
        return get_env_proxy_for_url(yarl.URL(server))
    except LookupError:
        return None, None


async def json_lines(chunks: AsyncIterator[bytes], max_line_bytes: int, where: str) -> AsyncIterator[Any]:
    """Each JSON line of a watch stream, decoded, from its body's chunks as they come (a line may
    span chunks, a chunk hold many lines); ``KubeError`` for a line over ``max_line_bytes`` (a
    bound on what one event may cost in memory), ``ValueError`` for one that is not JSON."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if line.strip():
                yield json.loads(line)
        if len(buffer) > max_line_bytes:
            raise KubeError(f"{where}: an event over {max_line_bytes} bytes")
    if buffer.strip():
        yield json.loads(bytes(buffer))
