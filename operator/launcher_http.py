"""The operator's one way to read a launcher's JSON endpoint (``/coldstart``, ``/progress``).

A launcher runs in a tenant's pod, so its answer is untrusted: the body is read up to a bound and
never further, and anything but a 200 with parseable JSON within it is "no answer" (None), logged
at debug level with the reason, never an error that could hold up a reconcile.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


async def get_launcher_json(
    session: aiohttp.ClientSession, ip: str, port: int, path: str, *, max_bytes: int, pod: str
) -> Any | None:
    """GET ``http://<ip>:<port><path>`` and parse its body, or None (see the module docstring)."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with session.get(f"http://{host}:{port}{path}") as response:
            if response.status != 200:
                return None
            body = await response.content.read(max_bytes + 1)
            if len(body) > max_bytes:
                log.info("launcher of pod %s sent a %s body over %d bytes", pod, path, max_bytes)
                return None
            return json.loads(body)
    except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as e:  # RecursionError: nested deeply
        log.debug("launcher of pod %s did not answer %s: %s", pod, path, e)
        return None
