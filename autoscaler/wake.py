"""Wake-ups: the router says a deployment has requests waiting and no replica.

``WakeInbox.request`` is the in-process wake (the router's ``InProcessWakeSignal`` calls it);
``POST /v1/wake`` with ``{"namespace": ..., "name": ...}`` is the HTTP one (answered 202). With a
token file (the chart mounts one Secret into the routers and the autoscaler), the HTTP wake needs
``Authorization: Bearer <token>``: a wake starts GPUs, so only the routers may send one. Either
sets an event the control loop waits on, so the decision happens at once rather than at the
next tick or the next scrape.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvfleet.spec import NAME_PATTERN
from kvfleet.wake_token import WakeToken

MAX_PENDING = 10_000
MAX_BODY_BYTES = 4096


class WakeInbox:
    """Pending wake-ups, bounded; a repeated wake for the same deployment is one entry."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._pending: set[tuple[str, str]] = set()
        self.event = asyncio.Event()

    def request(self, namespace: str, name: str) -> bool:
        """Ask for a replica. False when the inbox is full (the router retries or waits)."""
        key = (namespace, name)
        if key not in self._pending and len(self._pending) >= self.max_pending:
            return False
        self._pending.add(key)
        self.event.set()
        return True

    def take(self) -> set[tuple[str, str]]:
        """All pending wake-ups, clearing them."""
        pending, self._pending = self._pending, set()
        self.event.clear()
        return pending


def _bad(reason: str, status: int = 400) -> web.Response:
    return web.json_response({"error": reason}, status=status)


def wake_handler(inbox: WakeInbox, token: WakeToken | None = None) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        if token is not None and not token.accepts(request.headers.get("Authorization")):
            return _bad("a wake needs the router's token (Authorization: Bearer ...)", 401)
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _bad(f"body larger than {MAX_BODY_BYTES} bytes", 413)
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            return _bad(f"body larger than {MAX_BODY_BYTES} bytes", 413)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return _bad('body is not JSON; expected {"namespace": ..., "name": ...}')
        if not isinstance(body, dict):
            return _bad("body must be a JSON object with namespace and name")
        for field in ("namespace", "name"):
            value = body.get(field)
            if not isinstance(value, str) or not re.match(NAME_PATTERN, value) or len(value) > 63:
                return _bad(f"{field} must be a DNS-1035 label (got {str(value)[:70]!r})")
        if not inbox.request(body["namespace"], body["name"]):
            return _bad("too many pending wake-ups; retry shortly", 503)
        return web.json_response({"accepted": True}, status=202)

    return handle
