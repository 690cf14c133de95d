"""``KubeClient``: one kept HTTP connection pool to the API server, configured by lightkube.

lightkube does what must not be hand-written: kubeconfig contexts and in-cluster service accounts,
bearer tokens, ``tokenFile`` (re-read on a 401, so rotated service-account tokens are picked up),
exec plugins, client certificates and TLS verification, and the pooled async HTTP client itself.
This module adds only paths, JSON in and out, and one error tree mapped here, once: the status
code, the API server's message and its ``Retry-After`` travel in the ``KubeError``.

Why requests by path rather than lightkube's typed ``get``/``watch``: the router and autoscaler
read two resources as plain JSON (pydantic validates the spec), and lightkube's ``watch`` cannot
ask for bookmarks (``allowWatchBookmarks``), retries without back-off, and reports an HTTP-level
410 or 429 as a bare ``HTTPStatusError``; ``kvfleet.kube.watch`` does those over ``stream``.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx2
from lightkube.config.client_adapter import AsyncClient as _lightkube_http_client
from lightkube.config.client_adapter import ConnectionParams
from lightkube.config.kubeconfig import DEFAULT_KUBECONFIG, KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError

from kvfleet.kube.backoff import parse_retry_after

# httpx2 logs every request at INFO: a Lease renewal every 2 s would bury the log. Failures still
# surface, as this module's KubeError, where the caller logs them with what they mean.
logging.getLogger("httpx2").setLevel(logging.WARNING)

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
MAX_ERROR_CHARS = 500


class KubeError(Exception):
    """The API server refused a request or could not be reached. ``status`` is the HTTP status (None
    when no answer came); ``retry_after_s`` the server's Retry-After, when it sent one."""

    def __init__(self, message: str, status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        """No answer, 429 (priority and fairness shedding load, storage initializing) or 5xx heal by
        themselves; a 400/401/403/404 needs a person."""
        return self.status is None or self.status == 429 or self.status >= 500


class KubeNotFound(KubeError):
    """404: the object (or its resource type) does not exist."""


class KubeConflict(KubeError):
    """409: already exists, or the resourceVersion precondition failed."""


class KubeGone(KubeError):
    """410: the resourceVersion asked for is older than the API server keeps (list again)."""


class KubeUnavailable(KubeError):
    """No answer: connection refused or reset, timeout, TLS failure, unreadable credentials."""


class KubeUnreachable(KubeUnavailable):
    """No connection could be made at all (refused, connect timeout): nothing was missed meanwhile
    that a resumed watch would not replay."""


_BY_STATUS: dict[int, type[KubeError]] = {404: KubeNotFound, 409: KubeConflict, 410: KubeGone}


def error_for(status: int, message: str, retry_after_s: float | None = None) -> KubeError:
    return _BY_STATUS.get(status, KubeError)(message[:MAX_ERROR_CHARS], status, retry_after_s)


def load_config(kubeconfig: str | None = None, context: str | None = None) -> SingleConfig:
    """The in-cluster service account when running in a pod and no kubeconfig or context is named;
    else the kubeconfig (``kubeconfig``, else the first file in ``$KUBECONFIG``, else ~/.kube/config)."""
    if kubeconfig is None and context is None:
        try:
            in_pod = KubeConfig.from_service_account().get()
        except (ConfigError, KeyError):
            in_pod = None  # not in a pod (no token, or no KUBERNETES_SERVICE_HOST): the kubeconfig
        if in_pod is not None:
            return in_pod
    path = kubeconfig or (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or DEFAULT_KUBECONFIG
    try:
        config = KubeConfig.from_file(path).get(context)
    except (ConfigError, OSError, KeyError, TypeError, ValueError) as e:
        raise KubeError(f"kubeconfig {path}: {e}") from e
    if config is None:
        raise KubeError(f"kubeconfig {path}: no context")
    user = config.user
    if user is not None and user.token_file and not Path(user.token_file).is_absolute():
        # kubectl reads a relative tokenFile from the kubeconfig's folder; lightkube from the cwd.
        import msgspec

        config = config._replace(user=msgspec.structs.replace(user, token_file=str(config.abs_file(user.token_file))))
    return config


def server_config(url: str) -> SingleConfig:
    """A plain server URL and no credentials (a local emulator, ``kubectl proxy``)."""
    config = KubeConfig.from_one(cluster=Cluster(server=url), user=User()).get()
    assert config is not None
    return config


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
    ) -> None:
        if not 0 < timeout_s <= 300:
            raise ValueError(f"timeout_s must be in (0, 300], got {timeout_s}")
        if not 0 < connect_timeout_s <= 300:
            raise ValueError(f"connect_timeout_s must be in (0, 300], got {connect_timeout_s}")
        if not 2**12 <= max_event_bytes <= 2**26:
            raise ValueError("max_event_bytes must be in [4 KiB, 64 MiB]")
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
                self._http = _lightkube_http_client(self.config, ConnectionParams(timeout=timeout))
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
        try:
            detail = json.loads(text).get("message", "")
        except (ValueError, AttributeError):
            detail = text[:200]
        if detail:
            message += f" {detail}"
        return error_for(status, message, parse_retry_after(headers.get("Retry-After")))

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        return await self.request("POST", path, body, params={"fieldManager": field_manager})

    async def merge_patch(self, path: str, body: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        return await self.request("PATCH", path, body, params={"fieldManager": field_manager}, content_type=MERGE_PATCH)

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
