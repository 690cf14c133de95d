"""The launcher's log: one JSON object per event (``{"event": ..., ...}``), on one logger whichever
of its modules writes, so a log pipeline reads a launch as one stream."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("kvfleet.engine_image.launcher")


def log_event(event: str, **fields: Any) -> None:
    log.info(json.dumps({"event": event, **fields}, default=str))
