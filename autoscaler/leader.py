"""Leader election through a coordination.k8s.io/v1 Lease, so two autoscaler replicas never both act.

The rules are client-go's: a holder renews every ``retry_period_s``; anyone may take the Lease
once ``renewTime + leaseDurationSeconds`` has passed; the holder stops acting when it has not
renewed for ``renew_deadline_s`` (shorter than the lease duration, so it has stopped before anyone
else may start). Writes carry the resourceVersion they were based on, so on a real API server two
candidates racing for an expired Lease cannot both win (the loser gets 409 Conflict). A leader
renews from the Lease its last write returned, without reading it first (client-go does the same):
one request per renewal instead of two; a 409 means someone else wrote, and the next round reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from kvfleet.autoscaler.settings import FIELD_MANAGER, LeaseSettings
from kvfleet.kube import KubeClient, KubeConflict, KubeError, KubeNotFound, Ref

log = logging.getLogger(__name__)

LEASES = Ref("coordination.k8s.io/v1", "leases")

Verdict = Literal["create", "renew", "acquire", "follow"]


def _micro_time(at_s: float) -> str:
    return datetime.fromtimestamp(at_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def lease_verdict(lease: dict[str, Any] | None, identity: str, now_s: float) -> Verdict:
    """What a candidate should do with the Lease as read (pure)."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if holder == identity:
        return "renew"
    if not holder:
        return "acquire"
    renewed = _parse_time(spec.get("renewTime")) or _parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(duration, int | float):
        return "acquire"  # a Lease nobody can interpret is nobody's
    return "acquire" if now_s > renewed + float(duration) else "follow"


class LeaseElector:
    """Holds (or waits for) the Lease; ``is_leader`` is what the controller checks before acting."""

    def __init__(self, api: KubeClient, settings: LeaseSettings, clock: Callable[[], float]) -> None:
        self.api = api
        self.settings = settings
        self.clock = clock
        self._renewed_at_s: float | None = None
        self._written: dict[str, Any] | None = None  # the Lease as our last write returned it
        self.leader_changed = asyncio.Event()

    @property
    def path(self) -> str:
        return LEASES.item(self.settings.namespace, self.settings.name)

    @property
    def is_leader(self) -> bool:
        renewed = self._renewed_at_s
        return renewed is not None and self.clock() - renewed < self.settings.renew_deadline_s

    def _spec(self, now_s: float, transitions: int, acquire: bool) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.settings.identity,
            "leaseDurationSeconds": int(self.settings.lease_duration_s),
            "renewTime": _micro_time(now_s),
        }
        if acquire:
            spec["acquireTime"] = _micro_time(now_s)
            spec["leaseTransitions"] = transitions
        return spec

    async def step(self) -> bool:
        """One round: read, then create, renew, acquire or follow (a leader renews without reading).
        Returns ``is_leader``."""
        was_leader = self.is_leader
        now_s = self.clock()
        if was_leader and self._written is not None:
            return await self._renew_from_written(now_s, was_leader)
        try:
            lease: dict[str, Any] | None = await self.api.get(self.path)
        except KubeNotFound:
            lease = None
        except KubeError as e:
            log.warning("lease %s: cannot read (%s); %s", self.settings.name, e, self._keep_or_drop())
            return self._report(was_leader)
        verdict = lease_verdict(lease, self.settings.identity, now_s)
        try:
            if verdict == "create":
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.settings.name, "namespace": self.settings.namespace},
                    "spec": self._spec(now_s, 0, acquire=True),
                }
                self._written = await self.api.create(
                    LEASES.collection(self.settings.namespace),
                    body,
                    field_manager=FIELD_MANAGER,
                )
                self._renewed_at_s = now_s
            elif verdict in ("renew", "acquire"):
                assert lease is not None
                spec = lease.get("spec") or {}
                transitions = int(spec.get("leaseTransitions") or 0) + (1 if verdict == "acquire" else 0)
                patch: dict[str, Any] = {"spec": self._spec(now_s, transitions, acquire=verdict == "acquire")}
                version = (lease.get("metadata") or {}).get("resourceVersion")
                if version:
                    patch["metadata"] = {"resourceVersion": version}  # optimistic concurrency
                self._written = await self.api.merge_patch(self.path, patch, field_manager=FIELD_MANAGER)
                self._renewed_at_s = now_s
            else:
                self._renewed_at_s = self._written = None
        except KubeConflict:
            self._renewed_at_s = self._written = None  # someone else wrote first; they lead
        except KubeError as e:
            log.warning("lease %s: cannot %s (%s); %s", self.settings.name, verdict, e, self._keep_or_drop())
        return self._report(was_leader)

    async def _renew_from_written(self, now_s: float, was_leader: bool) -> bool:
        assert self._written is not None
        spec = self._written.get("spec") or {}
        if spec.get("holderIdentity") != self.settings.identity:
            self._written = None
            return await self.step()
        patch: dict[str, Any] = {"spec": self._spec(now_s, int(spec.get("leaseTransitions") or 0), acquire=False)}
        version = (self._written.get("metadata") or {}).get("resourceVersion")
        if version:
            patch["metadata"] = {"resourceVersion": version}
        try:
            self._written = await self.api.merge_patch(self.path, patch, field_manager=FIELD_MANAGER)
            self._renewed_at_s = now_s
        except KubeConflict:
            # Written since by someone else (or by us from another process): read it next round.
            self._renewed_at_s = self._written = None
        except KubeNotFound:
            self._written = None  # deleted: the next round (re)creates it while we still lead
        except KubeError as e:
            log.warning("lease %s: cannot renew (%s); %s", self.settings.name, e, self._keep_or_drop())
        return self._report(was_leader)

    def _keep_or_drop(self) -> str:
        return "still leading until the renew deadline" if self.is_leader else "not leading"

    def _report(self, was_leader: bool) -> bool:
        now_leader = self.is_leader
        if now_leader != was_leader:
            log.info("lease %s: %s", self.settings.name, "became leader" if now_leader else "lost leadership")
            self.leader_changed.set()
        return now_leader

    async def release(self) -> None:
        """Give the Lease up on shutdown so a standby takes over at once, not a lease duration later."""
        if self._renewed_at_s is None:
            return
        self._renewed_at_s = self._written = None
        try:
            lease = await self.api.get(self.path)
            if (lease.get("spec") or {}).get("holderIdentity") != self.settings.identity:
                return  # taken over meanwhile: not ours to release
            await self.api.merge_patch(
                self.path, {"spec": {"holderIdentity": None, "leaseDurationSeconds": 1}}, field_manager=FIELD_MANAGER
            )
        except KubeError as e:
            log.warning("lease %s: release failed (%s); it expires by itself", self.settings.name, e)

    async def run(self, stop: asyncio.Event) -> None:
        """Step every ``retry_period_s`` until ``stop`` is set, then release."""
        try:
            while not stop.is_set():
                await self.step()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.settings.retry_period_s)
        finally:
            await asyncio.shield(self.release())
