"""Why engine pods are not serving, read from their status the way `kubectl describe` shows it, so the
InferenceDeployment says it within seconds instead of after the Deployment's progress deadline.

Pure: pods in (as the API server returned them), one diagnosis out, with the kubelet's or the
scheduler's own reason and the container's termination message (the launcher writes its error
there: a missing manifest, a checksum mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_CHARS = 512  # a condition message is read in `kubectl get`/`describe`; the log has the rest

# Container waiting reasons that mean the pod will not start by itself, worst first.
WAITING_REASONS = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
# Ordering of every reason this module reports: the first one present across the pods wins.
SEVERITY = ("OOMKilled", *WAITING_REASONS, "Unschedulable")


@dataclass(frozen=True)
class PodDiagnosis:
    reason: str  # a condition reason: CrashLoopBackOff, ImagePullBackOff, OOMKilled, Unschedulable, ...
    message: str  # "<n>/<total> pods: <pod>: <what the kubelet or scheduler said>"


def _problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return "Unschedulable", str(cond.get("message") or "no node fits the pod")
    found: list[tuple[str, str]] = []
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        last = (cs.get("lastState") or {}).get("terminated") or {}
        waiting = (cs.get("state") or {}).get("waiting") or {}
        # The termination message is the launcher's own error (terminationMessagePolicy
        # FallbackToLogsOnError falls back to the log's tail when it wrote none).
        said = str(last.get("message") or "").strip()
        if last.get("reason") == "OOMKilled":
            found.append(
                ("OOMKilled", f"container {cs.get('name')} was killed out of memory" + (f": {said}" if said else ""))
            )
        reason = waiting.get("reason")
        if reason in WAITING_REASONS:
            detail = said if reason == "CrashLoopBackOff" and said else str(waiting.get("message") or reason)
            if reason == "CrashLoopBackOff" and last.get("exitCode") is not None:
                detail = f"exit code {last.get('exitCode')}: {detail}"
            found.append((reason, f"container {cs.get('name')}: {detail}"))
    if not found:
        return None
    return min(found, key=lambda f: SEVERITY.index(f[0]))


def diagnose_pods(pods: list[dict[str, Any]]) -> PodDiagnosis | None:
    """The worst problem among the pods (terminating pods are left out), or None when none has one."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    problems = [(p, found) for p in live if (found := _problem(p)) is not None]
    if not problems:
        return None
    pod, (reason, message) = min(problems, key=lambda pf: SEVERITY.index(pf[1][0]))
    same = sum(1 for _, (r, _m) in problems if r == reason)
    name = (pod.get("metadata") or {}).get("name", "?")
    text = f"{same}/{len(live)} pods {reason}; {name}: {' '.join(message.split())}"
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return PodDiagnosis(reason, text)
