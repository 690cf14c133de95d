"""API requests by kvfleet's components, from the API server's audit log (its policy records only
the kvfleet-system ServiceAccounts)."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cluster import RELEASE_NS, SA


def audit_entries(path: Path, since: str, until: str) -> list[dict[str, Any]]:
    found, seen = [], set()
    files = sorted(path.parent.glob("audit*.log"), key=lambda p: p.stat().st_mtime)
    for f in files:
        with open(f) as fh:
            for line in fh:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                stamp = e.get("requestReceivedTimestamp", "")
                if since <= stamp < until and e.get("auditID") not in seen:
                    seen.add(e.get("auditID"))
                    found.append(e)
    return found


def component_of(entry: dict[str, Any], routers: dict[str, str]) -> str | None:
    user = entry.get("user", {}).get("username", "")
    if not user.startswith(f"system:serviceaccount:{RELEASE_NS}:"):
        return None
    sa = user.rsplit(":", 1)[1]
    return {v: k for k, v in SA.items()}.get(sa)


def code_of(entry: dict[str, Any]) -> int:
    """The API server's answer (0: none recorded, e.g. a watch still open when the entry was cut)."""
    return int((entry.get("responseStatus") or {}).get("code") or 0)


def succeeded(entry: dict[str, Any]) -> bool:
    """Answered 2xx: a write that changed something (a 409, 422, 429 or a timeout changed nothing)."""
    return 200 <= code_of(entry) < 300


def by_component_and_verb(
    entries: list[dict[str, Any]], minutes: float, keep: Callable[[dict[str, Any]], bool] = lambda _: True
) -> dict[str, dict[str, float]]:
    """Requests per minute by component and verb (every answer; ``keep``: only those it keeps)."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in entries:
        comp = component_of(e, {})
        if comp is not None and keep(e):
            counts[comp][e.get("verb", "?")] += 1
    return {c: {v: round(n / minutes, 1) for v, n in sorted(vs.items())} for c, vs in counts.items()}


def by_request(entries: list[dict[str, Any]], component: str) -> dict[str, int]:
    """One component's requests by verb and resource (``patch inferencedeployments/status``), most first."""
    counts: collections.Counter[str] = collections.Counter()
    for e in entries:
        if component_of(e, {}) == component:
            ref = e.get("objectRef") or {}
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            counts[f"{e.get('verb', '?')} {resource}"] += 1
    return dict(counts.most_common())


def by_code(entries: list[dict[str, Any]], minutes: float = 1.0) -> dict[str, float]:
    """kvfleet's requests by the API server's answer (per minute when ``minutes`` is given)."""
    counts = collections.Counter(str(code_of(e)) for e in entries if component_of(e, {}))
    return {code: round(n / minutes, 1) for code, n in sorted(counts.items())}


def peak_per_second(entries: list[dict[str, Any]]) -> int:
    bins = collections.Counter(e.get("requestReceivedTimestamp", "")[:19] for e in entries if component_of(e, {}))
    return max(bins.values()) if bins else 0


WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
