"""Learn status.measuredColdStartSeconds and status.modelDigest from the launchers' ``/coldstart``
endpoints.

Why the operator asks the launcher (and not a pod annotation the launcher writes): writing an
annotation would need a Kubernetes token with ``pods/patch`` in every engine pod, and such a token
can patch any pod of the namespace. This way engine pods run with no token at all
(``automountServiceAccountToken: false``) and the operator needs only read access to pods
(``list``) plus a network path to port 9400 of the engine pods.

Each pod is asked once, after it turned Ready (the launcher then knows the total); the answer is
remembered by pod uid in a bounded LRU so a resync does not ask again. A pod that did not answer is
not asked again for ``UNANSWERED_RETRY_S`` (also remembered, bounded): an engine image without the
endpoint, or a network policy in the way, would otherwise cost every resync of every deployment a
timeout per pod (at 3,000 pods, thousands of requests and seconds of held reconciles a minute).
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from .launcher_http import get_launcher_json

MAX_REMEMBERED_PODS = 4096
UNANSWERED_RETRY_S = 600.0  # a launcher that did not answer is asked again after this
_DIGEST = re.compile(r"^[0-9a-f]{64}$")  # sha256 of the weight-cache manifest, hex


@dataclass(frozen=True)
class LauncherReport:
    """What one Ready pod's launcher measured: its cold start, and the digest of the weights it serves
    (None when it sent none, or not in a digest's shape)."""

    seconds: float
    model_digest: str | None


@dataclass(frozen=True)
class PodTarget:
    uid: str
    ip: str
    ready_since: str  # RFC 3339 time of the Ready transition; orders measurements


def ready_pods(pods: list[dict[str, Any]]) -> list[PodTarget]:
    """Pods that are Ready, have an IP and are not terminating, newest Ready first."""
    out: list[PodTarget] = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or not status.get("podIP") or not meta.get("uid"):
            continue
        for cond in status.get("conditions") or []:
            if cond.get("type") == "Ready" and cond.get("status") == "True":
                out.append(PodTarget(str(meta["uid"]), str(status["podIP"]), str(cond.get("lastTransitionTime") or "")))
    return sorted(out, key=lambda p: p.ready_since, reverse=True)


def parse_coldstart(doc: Any) -> float | None:
    """The launcher's total cold start in seconds (docs/contracts.md), or None when malformed."""
    if not isinstance(doc, dict):
        return None
    value = doc.get("totalSeconds")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0 or value > 86_400:
        return None
    return float(value)


def parse_model_digest(doc: Any) -> str | None:
    """The manifest digest the launcher served (64 lowercase hex), or None when absent or malformed:
    a tenant's pod answers, so nothing but a digest's shape reaches status."""
    value = doc.get("modelDigest") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and _DIGEST.match(value) else None


MAX_COLDSTART_BYTES = 4096  # the launcher's answer is a few hundred bytes of JSON


class ColdStartProbe:
    """Asks launchers for their cold-start figure; remembers answers by pod uid (bounded)."""

    def __init__(
        self,
        *,
        port: int,
        timeout_s: float,
        pods_per_tick: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._port = port
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._pods_per_tick = pods_per_tick
        self._clock = clock
        self._known: OrderedDict[str, LauncherReport] = OrderedDict()  # by pod uid
        self._unanswered: OrderedDict[str, float] = OrderedDict()  # pod uid -> when it failed to answer
        self.asked = 0  # requests sent, for tests and logs

    def _waiting(self, uid: str, now: float) -> bool:
        failed_at = self._unanswered.get(uid)
        return failed_at is not None and now - failed_at < UNANSWERED_RETRY_S

    async def _fetch(self, session: aiohttp.ClientSession, pod: PodTarget) -> LauncherReport | None:
        doc = await get_launcher_json(
            session, pod.ip, self._port, "/coldstart", max_bytes=MAX_COLDSTART_BYTES, pod=pod.uid
        )
        seconds = parse_coldstart(doc)
        return None if seconds is None else LauncherReport(seconds, parse_model_digest(doc))

    async def latest(self, pods: list[dict[str, Any]]) -> LauncherReport | None:
        """The report of the most recently Ready pod that sent one (None when none did)."""
        targets = ready_pods(pods)
        now = self._clock()
        unknown = [p for p in targets if p.uid not in self._known and not self._waiting(p.uid, now)]
        unknown = unknown[: self._pods_per_tick]
        if unknown:
            async with aiohttp.ClientSession(timeout=self._timeout) as session:
                for pod in unknown:
                    self.asked += 1
                    report = await self._fetch(session, pod)
                    if report is not None:
                        self._remember(pod, report)
                    else:
                        self._unanswered[pod.uid] = now
                        self._unanswered.move_to_end(pod.uid)
                        while len(self._unanswered) > MAX_REMEMBERED_PODS:
                            self._unanswered.popitem(last=False)
        for pod in targets:
            if pod.uid in self._known:
                return self._known[pod.uid]
        return None

    def _remember(self, pod: PodTarget, report: LauncherReport) -> None:
        self._known[pod.uid] = report
        self._known.move_to_end(pod.uid)
        while len(self._known) > MAX_REMEMBERED_PODS:
            self._known.popitem(last=False)
