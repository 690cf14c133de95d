"""``KubeClient``: one kept HTTP connection pool to the API server, configured by lightkube; the one
client of the operator, the router and the autoscaler.

lightkube does what must not be hand-written: kubeconfig contexts and in-cluster service accounts,
bearer tokens, ``tokenFile`` (re-read on a 401, so rotated service-account tokens are picked up),
exec plugins, client certificates and TLS verification, and the pooled async HTTP client itself.
This module adds only paths, JSON in and out, the verbs the components use, and the mapping of
every failure onto ``kvfleet.kube.errors`` (once, here): the status code, the API server's reason
and message and its ``Retry-After`` travel in the ``KubeError``.

Why requests by path rather than lightkube's typed ``get``/``watch``: every component reads and
writes objects as plain JSON (pydantic validates the spec; the operator renders its children as
dicts and server-side applies them), and lightkube's ``watch`` cannot
ask for bookmarks (``allowWatchBookmarks``), retries without back-off, and reports an HTTP-level
410 or 429 as a bare ``HTTPStatusError``; ``kvfleet.kube.watch`` does those over ``stream``.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2
from lightkube.config.client_adapter import ConnectionParams
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError

from kvfleet.kube.backoff import parse_retry_after
from kvfleet.kube.config import load_config, server_config
from kvfleet.kube.errors import KubeError, KubeNotFound, KubeUnavailable, KubeUnreachable, error_for
from kvfleet.kube.ref import Ref, group_path

# httpx2 logs every request at INFO: a Lease renewal every 2 s would bury the log. Failures still
# surface, as this module's KubeError, where the caller logs them with what they mean.
logging.getLogger("httpx2").setLevel(logging.WARNING)

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML, so the body is JSON
KEEPALIVE_S = 30.0  # an idle connection is closed after this (httpx: 5 s, a reconnect after every lull)


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
        (httpx keeps 20 by default: the operator's bursts of ~50 requests in flight closed and
        reopened connections all through an apply of 1,000 deployments, a TLS handshake each on
        both ends); a request beyond the bound waits for a free connection."""
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
        self._http: httpx2.AsyncClient | None = None

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None, context: str | None = None, **kw: Any) -> KubeClient:
        return cls(load_config(kubeconfig, context), **kw)

    @classmethod
    def for_server(cls, url: str, **kw: Any) -> KubeClient:
        return cls(server_config(url), **kw)

    @property
    def server(self) -> str:
        return str(self.config.cluster.server).rstrip("/")

    def _client(self) -> httpx2.AsyncClient:
        if self._http is None:
            timeout = httpx2.Timeout(self.timeout_s, connect=min(self.connect_timeout_s, self.timeout_s))
            try:
                # lightkube's parameters (TLS, credentials, base URL), with the pool's limits added.
                params = ConnectionParams(timeout=timeout).httpx_params(self.config)
                limits = httpx2.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=self.max_connections,
                    keepalive_expiry=KEEPALIVE_S,
                )
                self._http = httpx2.AsyncClient(**params, limits=limits)
            except (ConfigError, OSError, ssl.SSLError) as e:
                raise KubeUnavailable(f"cannot set up a client for {self.server}: {e}") from e
            self._http.headers["User-Agent"] = self._user_agent
            self._http.headers["Accept"] = JSON
        return self._http

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
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
        headers = {"Content-Type": content_type} if body is not None else None
        content = json.dumps(body).encode() if body is not None else None
        where = f"{method} {path}"
        try:
            response = await self._client().request(
                method, path, params=dict(params or {}), content=content, headers=headers
            )
        except (httpx2.HTTPError, ConfigError, OSError, ssl.SSLError) as e:
            raise KubeUnavailable(f"{where}: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            raise self._status_error(where, response.status_code, response.text, response.headers)
        try:
            result = response.json() if response.content else {}
        except ValueError as e:
            raise KubeError(f"{where}: response is not JSON", response.status_code) from e
        if not isinstance(result, dict):
            raise KubeError(f"{where}: response is not a JSON object", response.status_code)
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
        timeout = httpx2.Timeout(
            self.timeout_s, connect=min(self.connect_timeout_s, self.timeout_s), read=read_timeout_s
        )
        try:
            async with self._client().stream("GET", path, params=dict(params), timeout=timeout) as response:
                if response.status_code != 200:
                    text = (await response.aread())[:4096].decode(errors="replace")
                    raise self._status_error(where, response.status_code, text, response.headers)
                buffer = bytearray()
                async for chunk in response.aiter_bytes():
                    buffer += chunk
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[: end + 1]
                        if line.strip():
                            yield json.loads(line)
                    if len(buffer) > self.max_event_bytes:
                        raise KubeError(f"{where}: an event over {self.max_event_bytes} bytes")
                if buffer.strip():
                    yield json.loads(bytes(buffer))
        except KubeError:
            raise
        except ValueError as e:
            raise KubeError(f"{where}: an event that is not JSON: {e}") from e
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
            raise KubeUnreachable(f"{where}: {type(e).__name__}: {e}") from e
        except (httpx2.HTTPError, ConfigError, OSError, ssl.SSLError) as e:
            raise KubeUnavailable(f"{where}: {type(e).__name__}: {e}") from e
