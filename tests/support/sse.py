"""One reader of a streamed OpenAI answer's server-sent events, for the tests that stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

DONE = "[DONE]"


async def data_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | str]:
    """Each event's ``data:`` payload as it arrives: a JSON object parsed, ``[DONE]`` as the string.
    Comment lines (``: ...``, the router's cold-start progress) are skipped; an event's several
    ``data:`` lines are joined with newlines, as the SSE standard says."""
    lines: list[str] = []
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
            continue
        if line or not lines:
            continue
        payload, lines = "\n".join(lines), []
        yield payload if payload == DONE else json.loads(payload)
    if lines:  # the body ended without the closing blank line
        payload = "\n".join(lines)
        yield payload if payload == DONE else json.loads(payload)
