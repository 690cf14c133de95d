"""The ``Authorization`` header for a kubeconfig user: lightkube's auth flow, driven by hand.

lightkube's auths (a token, a re-read ``tokenFile``, an exec plugin, basic auth) are httpx ``Auth``
flows: a generator that sets the header on a request and, handed a 401 answer, may set a fresh one
and send the request once more. ``KubeClient`` (aiohttp) and the operator's kopf login send what
the flow sets; the flow runs here, on a stand-in request, so no credential logic is written twice.
The header is kept until a 401, as lightkube's flows keep theirs.
"""

from __future__ import annotations

import asyncio

import httpx2
from lightkube.config.client_adapter import user_auth
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError

from kvfleet.kube.errors import KubeError

UNAUTHORIZED = 401


class Credentials:
    """The header one client sends (None: no credentials, e.g. client certificates only)."""

    def __init__(self, config: SingleConfig) -> None:
        self._config = config
        self._auth: httpx2.Auth | None = None
        self._header: str | None = None
        self._loaded = False
        self._lock = asyncio.Lock()  # one exec plugin run, one file read, however many requests wait

    async def header(self) -> str | None:
        """The header for the next request: the flow's first, kept until a 401."""
        if not self._loaded:
            async with self._lock:
                if not self._loaded:
                    self._header = await self._run(refused=False)
                    self._loaded = True
        return self._header

    async def refreshed(self, refused: str | None) -> str | None:
        """After a 401 to a request sent with ``refused``: the header to send it with once more (a
        rotated token read again, an exec plugin run again), or None when the flow has no second
        try (a fixed token or password: the 401 stands)."""
        async with self._lock:
            if self._loaded and self._header != refused:
                return self._header  # another request's 401 renewed it meanwhile
            fresh = await self._run(refused=True)
            if fresh is not None:
                self._header, self._loaded = fresh, True
            return fresh

    async def _run(self, *, refused: bool) -> str | None:
        server = self._config.cluster.server
        try:
            if self._auth is None:
                if self._config.user is None:
                    return None
                self._auth = user_auth(self._config.user)
                if self._auth is None:
                    return None
            flow = self._auth.async_auth_flow(httpx2.Request("GET", server))
            try:
                request = await flow.__anext__()
                if refused:
                    try:
                        request = await flow.asend(httpx2.Response(UNAUTHORIZED, request=request))
                    except StopAsyncIteration:
                        return None
            finally:
                await flow.aclose()
        except (ConfigError, OSError, ValueError, KeyError) as e:
            raise KubeError(f"credentials for {server}: {e}") from e
        return request.headers.get("Authorization")


async def authorization_header(config: SingleConfig) -> str | None:
    """The ``Authorization`` header a first request with ``config`` carries."""
    return await Credentials(config).header()
