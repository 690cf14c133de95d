"""Who keeps a served name two InferenceDeployments claim: one rule for the router and the operator.

A served name is unique across the cluster. The oldest claimant (``metadata.creationTimestamp``)
keeps it; the same second is decided by namespace, then name. Age, not the order names sort in, so
a newer deployment in a namespace that sorts first can never take another's traffic; and every
router and the operator reach the same answer from the objects alone (docs/router.md, Namespaces).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any


def created_unix_s(obj: Mapping[str, Any]) -> int | None:
    """``metadata.creationTimestamp`` (RFC 3339, set by the API server) in Unix seconds; None when absent or bad."""
    meta = obj.get("metadata")
    stamp = meta.get("creationTimestamp") if isinstance(meta, Mapping) else None
    if not isinstance(stamp, str):
        return None
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return int(parsed.timestamp()) if parsed.tzinfo is not None else None


def claim_order(created: int | None, namespace: str, name: str) -> tuple[float, str, str]:
    """Sort key of a claim: the smallest keeps the name. An undated claim sorts last, so a claimant
    the API server dated is never displaced by one it did not."""
    return (float(created) if created is not None else float("inf"), namespace, name)
