"""The wake token the routers send and the autoscaler requires (the chart's ``<release>-wake-token``
Secret, mounted into both): one reader, so both sides bound and trim the file alike."""

from __future__ import annotations

import hmac
from pathlib import Path

__all__ = ["MAX_TOKEN_BYTES", "WakeToken"]

MAX_TOKEN_BYTES = 4096


class WakeToken:
    """The shared wake token, read from a file on every check (a rotated Secret takes effect without
    a restart) and never logged."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            token = f.read(MAX_TOKEN_BYTES + 1).strip()
        if not token or len(token) > MAX_TOKEN_BYTES:
            raise ValueError(f"wake token file {self.path} is empty or over {MAX_TOKEN_BYTES} bytes")
        return token

    def accepts(self, authorization: str | None) -> bool:
        if not authorization or not authorization.startswith("Bearer "):
            return False
        return hmac.compare_digest(authorization[len("Bearer ") :].strip().encode(), self.read())
