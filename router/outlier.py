"""Passive outlier ejection: a replica that fails several times in a row is left out for a while.

Pure bookkeeping: the caller passes the time in. The ejection doubles on each repeat (up to a cap)
and resets after a success, so a flapping replica is kept out longer and a recovered one returns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _ReplicaHealth:
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until_s: float = 0.0


class OutlierDetector:
    def __init__(self, *, failures_to_eject: int, base_ejection_s: float, max_ejection_s: float) -> None:
        if failures_to_eject < 1:
            raise ValueError("failures_to_eject must be >= 1")
        if base_ejection_s <= 0 or max_ejection_s < base_ejection_s:
            raise ValueError("need 0 < base_ejection_s <= max_ejection_s")
        self._failures_to_eject = failures_to_eject
        self._base_s = base_ejection_s
        self._max_s = max_ejection_s
        self._health: dict[str, _ReplicaHealth] = {}
        self._any_until_s = 0.0  # the latest ejection end ever set: before it, nobody can be ejected

    def record_success(self, replica_id: str) -> None:
        health = self._health.get(replica_id)
        if health is not None:
            health.consecutive_failures = 0
            health.ejections = 0

    def record_failure(self, replica_id: str, now_s: float) -> float | None:
        """Count a failure; returns the ejection length when this failure ejects the replica."""
        health = self._health.setdefault(replica_id, _ReplicaHealth())
        health.consecutive_failures += 1
        if health.consecutive_failures < self._failures_to_eject:
            return None
        length_s = min(self._max_s, self._base_s * 2**health.ejections)
        health.ejections = min(health.ejections + 1, 32)  # bounded exponent
        health.consecutive_failures = 0
        health.ejected_until_s = now_s + length_s
        self._any_until_s = max(self._any_until_s, health.ejected_until_s)
        return length_s

    def none_ejected(self, now_s: float) -> bool:
        """True when no replica can be ejected at ``now_s`` (one comparison: the routing path asks per request)."""
        return now_s >= self._any_until_s

    def is_ejected(self, replica_id: str, now_s: float) -> bool:
        health = self._health.get(replica_id)
        return health is not None and now_s < health.ejected_until_s

    def forget(self, replica_id: str) -> None:
        self._health.pop(replica_id, None)

    def tracked(self) -> list[str]:
        return sorted(self._health)
