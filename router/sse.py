"""Server-sent events at event boundaries: forward whole events only, and end a broken stream with an
error event a client can parse (never a silent truncation, never half an event glued to ours)."""

from __future__ import annotations

import json

from kvfleet.openai_shape import error_body

_BOUNDARIES = (b"\n\n", b"\r\n\r\n", b"\r\r")


class EventSplitter:
    """Feeds raw chunks, returns the bytes up to the last complete event; holds the partial tail.

    The tail is bounded: past ``max_pending_bytes`` it is forwarded as is (a huge single event is
    passed through unsplit rather than held in memory).
    """

    def __init__(self, max_pending_bytes: int) -> None:
        self._max_pending = max_pending_bytes
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        end = max(data.rfind(b) + len(b) if data.rfind(b) >= 0 else 0 for b in _BOUNDARIES)
        if end == 0 and len(data) <= self._max_pending:
            self._pending = data
            return b""
        if len(data) - end > self._max_pending:
            self._pending = b""
            return data
        self._pending = data[end:]
        return data[:end]

    def flush(self) -> bytes:
        """What is left when the upstream ended cleanly (an unterminated last event, passed as is)."""
        data, self._pending = self._pending, b""
        return data

    def discard(self) -> int:
        """Drop the partial event of a broken stream; returns how many bytes were dropped."""
        dropped, self._pending = len(self._pending), b""
        return dropped


def error_event(message: str, *, kind: str = "upstream_disconnected") -> bytes:
    """An SSE event carrying an OpenAI-style error object (what vLLM sends when a stream fails)."""
    payload = error_body(message, kind, code=kind)
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
