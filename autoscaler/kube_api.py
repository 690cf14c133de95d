"""A small async Kubernetes API client: the few calls the autoscaler makes, over aiohttp.

Why not the ``kubernetes`` client: it is synchronous, and the autoscaler's loop, wake endpoint
and Lease renewals share one event loop; a blocked thread per call would also hide timeouts.
What we do take from it is the configuration loader (kubeconfig contexts, exec plugins,
in-cluster service-account tokens and their rotation), so authentication is not hand-written.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "kvfleet-autoscaler"


class KubeError(Exception):
    """The API server answered with an error status (or could not be reached)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeNotFound(KubeError):
    """404: the object (or its resource type) does not exist."""


class KubeConflict(KubeError):
    """409: already exists, or the resourceVersion precondition failed."""


class KubeUnavailable(KubeError):
    """No answer: connection refused, timeout, TLS failure."""


@dataclass(frozen=True)
class KubeConnection:
    """Where the API server is and how to authenticate; secrets never appear in repr or logs."""

    server: str
    authorization: Callable[[], str | None] = field(default=lambda: None, repr=False)
    """Returns the Authorization header value (re-read per request: tokens rotate)."""
    ca_file: str | None = None
    client_cert: tuple[str, str] | None = field(default=None, repr=False)
    verify_tls: bool = True

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https://"):
            return False
        if not self.verify_tls:
            return False
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.client_cert is not None:
            context.load_cert_chain(*self.client_cert)
        return context


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> KubeConnection:
    """In-cluster service account when running in a pod, else the kubeconfig (``$KUBECONFIG``)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig is None and context is None:
            config.load_incluster_config(client_configuration=configuration)
        else:
            raise config.ConfigException("a kubeconfig was named")
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)

    def authorization() -> str | None:
        # kubernetes >= 31 keeps the token under "BearerToken" ("authorization" before): reading
        # only the old key sent every token-authenticated request anonymously.
        value = configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        return str(value) if value else None

    cert = (
        (configuration.cert_file, configuration.key_file)
        if configuration.cert_file and configuration.key_file
        else None
    )
    return KubeConnection(
        server=str(configuration.host).rstrip("/"),
        authorization=authorization,
        ca_file=configuration.ssl_ca_cert,
        client_cert=cert,
        verify_tls=bool(configuration.verify_ssl),
    )


class KubeApi:
    """JSON in, JSON out; errors mapped once, here, to the ``KubeError`` tree."""

    def __init__(self, connection: KubeConnection, *, timeout_s: float = 10.0) -> None:
        if not 0 < timeout_s <= 300:
            raise ValueError(f"timeout_s must be in (0, 300], got {timeout_s}")
        self.connection = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Accept": "application/json"}
        auth = self.connection.authorization()
        if auth:
            headers["Authorization"] = auth
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        url = self.connection.server + path
        try:
            async with self._session.request(
                method, url, data=data, headers=headers, ssl=self.connection.ssl_context()
            ) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError) as e:
            raise KubeUnavailable(f"{method} {path}: {type(e).__name__}") from e
        if status >= 400:
            message = f"{method} {path}: HTTP {status}"
            with contextlib.suppress(ValueError, AttributeError):
                message += f" {json.loads(text).get('message', '')}".rstrip()
            error = {404: KubeNotFound, 409: KubeConflict}.get(status, KubeError)
            raise error(message[:500], status)
        try:
            result = json.loads(text) if text else {}
        except ValueError as e:
            raise KubeError(f"{method} {path}: response is not JSON", status) from e
        if not isinstance(result, dict):
            raise KubeError(f"{method} {path}: response is not a JSON object", status)
        return result

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", f"{path}?fieldManager={FIELD_MANAGER}", body)

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", f"{path}?fieldManager={FIELD_MANAGER}", body, content_type=MERGE_PATCH)
