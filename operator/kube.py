"""A small async Kubernetes API client for the operator's own calls (apply, get, delete, status, events).

kopf talks to the API for watching and its own bookkeeping; the reconciler needs server-side apply,
status patches and discovery, which kopf does not expose. The official ``kubernetes`` client is
synchronous (it would block kopf's event loop or need a thread per call), so this is a thin aiohttp
layer over the credentials kopf's login produced (``kopf.ConnectionInfo``: the same token, CA and
client certificate kopf itself uses). Failures map once, here, onto a narrow error tree.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

USER_AGENT = "kvfleet-operator/0.1"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML, so the body is JSON
MERGE_CONTENT_TYPE = "application/merge-patch+json"


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotFound(KubeError):
    pass


class Rejected(KubeError):
    """400/403/422: the server refused what we sent; sending it again will not help."""


class Unavailable(KubeError):
    """No answer, 401 (credentials rotating), 429 or 5xx: worth retrying later."""


def _error_for(status: int, reason: str, message: str) -> KubeError:
    if status == 404:
        return NotFound(status, reason, message)
    if status == 409:
        # A conflict (a field another manager owns, a stale resourceVersion): no handler needs to
        # tell it apart; the reconcile is retried with fresh state like any other failed call.
        return KubeError(status, reason, message)
    if status in (400, 403, 405, 415, 422):
        return Rejected(status, reason, message)
    return Unavailable(status, reason, message)


@dataclass(frozen=True)
class Ref:
    """Addresses one resource type: apiVersion ("v1", "apps/v1") and the URL plural."""

    api_version: str
    plural: str

    def collection(self, namespace: str | None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        return f"{base}/namespaces/{namespace}/{self.plural}" if namespace else f"{base}/{self.plural}"

    def item(self, namespace: str | None, name: str, subresource: str | None = None) -> str:
        path = f"{self.collection(namespace)}/{name}"
        return f"{path}/{subresource}" if subresource else path


class Credentials:
    """The latest ConnectionInfo from kopf's login; replaced when kopf logs in again."""

    def __init__(self, info: kopf.ConnectionInfo | None = None) -> None:
        self.info = info

    def set(self, info: kopf.ConnectionInfo) -> None:
        self.info = info


class KubeClient:
    """Async API calls over one aiohttp session, rebuilt when the credentials change."""

    def __init__(self, credentials: Credentials, *, timeout_s: float) -> None:
        self._credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._session_info: kopf.ConnectionInfo | None = None
        self._lock = asyncio.Lock()

    async def _session_for(self) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        info = self._credentials.info
        if info is None:
            raise Unavailable(0, "NotLoggedIn", "no credentials yet (kopf has not logged in)")
        async with self._lock:
            if self._session is None or self._session_info is not info:
                if self._session is not None:
                    await self._session.close()
                ssl: Any = info.as_ssl_context() if info.server.startswith("https:") else None
                self._session = aiohttp.ClientSession(
                    base_url=info.server.rstrip("/") + "/",
                    headers={**info.as_http_headers(), "User-Agent": USER_AGENT},
                    connector=aiohttp.TCPConnector(ssl=ssl if ssl is not None else True, limit=16),
                    timeout=self._timeout,
                    trust_env=info.trust_env,
                )
                self._session_info = info
            return self._session, info

    async def close(self) -> None:
        async with self._lock:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        session, _ = await self._session_for()
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type, "Accept": "application/json"} if data is not None else {}
        try:
            async with session.request(
                method, path.lstrip("/"), data=data, headers=headers, params=params or {}
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    reason, message = response.reason or "Error", text[:2000]
                    try:
                        payload = json.loads(text)
                        reason = str(payload.get("reason") or reason)
                        message = str(payload.get("message") or message)
                    except (ValueError, AttributeError):
                        pass
                    raise _error_for(response.status, reason, message)
                return json.loads(text) if text else None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise Unavailable(0, type(e).__name__, str(e) or "no answer from the API server") from e

    # --- verbs the reconciler uses

    async def get(self, ref: Ref, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self.request("GET", ref.item(namespace, name))
        except NotFound:
            return None
        return result

    async def list(self, ref: Ref, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = await self.request("GET", ref.collection(namespace), params={"labelSelector": label_selector})
        return list(result.get("items") or [])

    async def apply(self, ref: Ref, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply; force takes fields back from whoever edited them by hand."""
        meta = obj["metadata"]
        params = {"fieldManager": field_manager, "force": "true"}
        path = ref.item(meta.get("namespace"), meta["name"])
        result: dict[str, Any] = await self.request(
            "PATCH", path, body=obj, content_type=APPLY_CONTENT_TYPE, params=params
        )
        return result

    async def patch_status(
        self, ref: Ref, namespace: str, name: str, status: dict[str, Any], field_manager: str
    ) -> dict[str, Any]:
        """A merge patch of ``status`` through the status subresource (never touches spec)."""
        path = ref.item(namespace, name, "status")
        params = {"fieldManager": field_manager}
        result: dict[str, Any] = await self.request(
            "PATCH", path, body={"status": status}, content_type=MERGE_CONTENT_TYPE, params=params
        )
        return result

    async def delete(self, ref: Ref, namespace: str, name: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", ref.item(namespace, name), body=body)
        except NotFound:
            return False
        return True

    async def serves(self, api_version: str, plural: str) -> bool:
        """Discovery: does the server serve this resource? (Needs no RBAC: discovery is public.)"""
        path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        try:
            doc = await self.request("GET", path)
        except NotFound:
            return False
        return any(r.get("name") == plural for r in (doc or {}).get("resources") or [])
