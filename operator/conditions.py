"""The InferenceDeployment status as a pure function of what the operator observed.

Every condition carries a reason and a message; a change of a condition's status or reason is a
transition, and each transition becomes one Kubernetes Event (the reconciler posts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvfleet.status import (
    CONDITION_TYPES,
    Condition,
    ConditionStatus,
    ConditionType,
    InferenceDeploymentStatus,
    status_patch,
    status_time,
)

from . import claims
from .pod_health import PodDiagnosis
from .pull_progress import PullsSeen


@dataclass(frozen=True)
class DeploymentObservation:
    """The parts of the engine Deployment (as the API server returned it) that status needs."""

    spec_replicas: int
    generation: int
    observed_generation: int
    replicas: int
    ready_replicas: int
    updated_replicas: int
    available_replicas: int
    deadline_exceeded: str | None  # the Deployment's message when its rollout timed out
    replica_failure: str | None  # e.g. a quota refusing pods

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> DeploymentObservation:
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        meta = obj.get("metadata") or {}
        deadline = failure = None
        for cond in status.get("conditions") or []:
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                deadline = str(cond.get("message") or "rollout exceeded its progress deadline")
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                failure = str(cond.get("message") or cond.get("reason") or "replica failure")
        return cls(
            spec_replicas=int(spec.get("replicas", 1)),
            generation=int(meta.get("generation") or 0),
            observed_generation=int(status.get("observedGeneration") or 0),
            replicas=int(status.get("replicas") or 0),
            ready_replicas=int(status.get("readyReplicas") or 0),
            updated_replicas=int(status.get("updatedReplicas") or 0),
            available_replicas=int(status.get("availableReplicas") or 0),
            deadline_exceeded=deadline,
            replica_failure=failure,
        )


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from; no I/O happens after this is built."""

    generation: int | None
    desired_replicas: int | None  # None when the spec is invalid (nothing was decided)
    replica_reason: str
    autoscaling: bool
    deployment: DeploymentObservation | None
    invalid_spec: str | None  # "spec.x: why; spec.y: why" when the spec failed validation
    apply_error: str | None
    endpoint: str
    selector: str
    measured_cold_start_s: float | None
    pods: PodDiagnosis | None = None  # why engine pods are not serving (crash loop, image pull, ...)
    pulls: PullsSeen | None = None  # weight pulls the launchers of not-ready pods report
    model_digest: str | None = None  # the manifest digest the newest Ready pod's launcher served
    policy_violation: str | None = None  # "spec.x: why" when the platform policy refuses the spec
    name_conflict: str | None = None  # 'served name "x" is already served by ns/name since ...' (claims.py)

    @property
    def refusal(self) -> tuple[str, str] | None:
        """(reason, message) when nothing was applied because the spec was refused."""
        if self.invalid_spec is not None:
            return "InvalidSpec", self.invalid_spec
        if self.policy_violation is not None:
            return "PolicyViolation", self.policy_violation
        return None


@dataclass(frozen=True)
class Cond:
    type: ConditionType
    status: ConditionStatus
    reason: str
    message: str


@dataclass(frozen=True)
class Transition:
    """A condition that changed, to be posted as an Event."""

    condition: Cond
    event_type: str  # Normal or Warning


@dataclass(frozen=True)
class StatusPlan:
    status: dict[str, Any]  # the status keys the operator owns, wire form (``status_patch`` of the model)
    transitions: tuple[Transition, ...]


def _desired(obs: Observed) -> int:
    """The replicas decided; with an invalid spec nothing new was decided: what the existing
    Deployment asks for."""
    if obs.desired_replicas is not None:
        return obs.desired_replicas
    return obs.deployment.spec_replicas if obs.deployment is not None else 0


def _up_to(count: int, desired: int) -> int:
    """Pure: a pod count as status reports it, at most the desired count (while it is above zero):
    a rolling update's surge pod (maxSurge 1) is not counted, so the three pod steps of each replica
    it replaces (surge pod made, ready, old pod gone) leave status as it was instead of writing
    4, then 3, again and again; the engine Deployment's own status counts it. Scaling to zero the
    pods still serving are counted until they are gone."""
    return min(count, desired) if desired > 0 else count


def _rollout_state(dep: DeploymentObservation, desired: int) -> tuple[bool, str]:
    """(in progress, why), the way `kubectl rollout status` decides."""
    if dep.observed_generation < dep.generation:
        return True, "the Deployment controller has not seen the latest template yet"
    if dep.updated_replicas < desired or dep.replicas > dep.updated_replicas:
        # One message per replica moved to the new template, not per pod step (a surge pod made,
        # ready, an old one gone): each new message is a status write, and a change rolling 1,000
        # deployments at once wrote ten a rollout of three replicas where five say the same.
        return True, f"{min(dep.updated_replicas, desired)}/{desired} replicas run the current template"
    if dep.ready_replicas < desired:
        return True, f"{dep.ready_replicas}/{desired} replicas ready"
    return False, f"{dep.ready_replicas}/{desired} replicas ready and current"


def _conditions(obs: Observed) -> list[Cond]:
    dep = obs.deployment
    if obs.name_conflict is not None:
        # Not routed whatever its replicas do (the router keeps the name for the older claimant), so
        # never Ready; nothing is applied until the name is free.
        held = "children left as they were until the served name is free"
        return [
            Cond("Ready", "False", claims.REASON, obs.name_conflict),
            Cond("Progressing", "False", claims.REASON, held),
            Cond("Degraded", "True", claims.REASON, obs.name_conflict),
            Cond("ScaledToZero", "False", claims.REASON, held),
        ]
    degraded: Cond
    refusal = obs.refusal
    if refusal is not None:
        degraded = Cond("Degraded", "True", *refusal)
    elif obs.apply_error is not None:
        degraded = Cond("Degraded", "True", "ApplyFailed", obs.apply_error)
    elif obs.pods is not None:
        # The kubelet's or scheduler's own reason, seconds after it happens; the Deployment's
        # progress deadline would say only "timed out", minutes later.
        degraded = Cond("Degraded", "True", obs.pods.reason, obs.pods.message)
    elif dep is not None and dep.deadline_exceeded is not None:
        degraded = Cond("Degraded", "True", "ProgressDeadlineExceeded", dep.deadline_exceeded)
    elif dep is not None and dep.replica_failure is not None:
        degraded = Cond("Degraded", "True", "ReplicaFailure", dep.replica_failure)
    else:
        degraded = Cond("Degraded", "False", "AsExpected", "no problem seen")

    # With an invalid spec nothing new was decided: report what the existing Deployment does.
    desired = _desired(obs)

    if dep is None:
        why = "fix the spec; no child was created" if refusal else "creating the engine Deployment"
        reason = refusal[0] if refusal else "Creating"
        return [
            Cond("Ready", "False", reason, why),
            Cond("Progressing", "False" if refusal else "True", reason, why),
            degraded,
            Cond("ScaledToZero", "False", reason, why),
        ]

    if desired == 0:
        if dep.replicas == 0:
            ready = Cond("Ready", "True", "ScaledToZero", "0 replicas; the router wakes the deployment on a request")
            progressing = Cond("Progressing", "False", "Idle", "scaled to zero")
            zero = Cond("ScaledToZero", "True", "ScaledToZero", obs.replica_reason)
        else:
            ready = Cond("Ready", "True", "ScalingToZero", f"{dep.ready_replicas} replicas still serving")
            progressing = Cond("Progressing", "True", "ScalingDown", f"{dep.replicas} replicas terminating")
            zero = Cond("ScaledToZero", "False", "ScalingDown", f"{dep.replicas} replicas terminating")
        return [ready, progressing, degraded, zero]

    if dep.ready_replicas > 0:
        ready = Cond(
            "Ready", "True", "ReplicasReady", f"{_up_to(dep.ready_replicas, desired)}/{desired} replicas ready"
        )
    else:
        ready = Cond("Ready", "False", "NoReplicaReady", f"0/{desired} replicas ready; engines are starting")
    moving, why = _rollout_state(dep, desired)
    if refusal is not None:
        progressing = Cond("Progressing", "False", refusal[0], "fix the spec; children left as they were")
    elif moving:
        template_moving = (
            dep.observed_generation < dep.generation
            or dep.updated_replicas < desired
            or dep.replicas > dep.updated_replicas
        )
        reason = "RollingOut" if template_moving else "ScalingUp"
        if obs.pulls is not None:
            # The reason stays: a pull is part of rolling out or scaling up, and a new reason would
            # post an Event each time one starts or ends. The message moves with the bytes.
            why = f"{why}; {obs.pulls.message()}"
        progressing = Cond("Progressing", "True", reason, why)
    else:
        progressing = Cond("Progressing", "False", "Complete", why)
    zero = Cond("ScaledToZero", "False", "Running", obs.replica_reason)
    return [ready, progressing, degraded, zero]


_EVENT_PRIORITY: tuple[ConditionType, ...] = ("Degraded", "Ready", "ScaledToZero", "Progressing")


def _noteworthy_first(cond: Cond) -> bool:
    # A condition seen for the first time is worth an Event unless it only says "all is well".
    return not (cond.type in ("Degraded", "ScaledToZero") and cond.status == "False")


def _event_worthy(cond: Cond, old: dict[str, Any] | None) -> bool:
    """A transition that gets an Event. Ready and Progressing speak when their status flips (a
    reason moving within one status, Creating to NoReplicaReady or RollingOut to ScalingUp, is the
    bring-up going as it should: status says it, an Event per step cost the API server a write
    for each of 1,000 deployments applied at once), and so does ScaledToZero; Degraded=True on a
    new reason too (ImagePullBackOff to CrashLoopBackOff is news)."""
    if old is None:
        return _noteworthy_first(cond)
    if old.get("status") != cond.status:
        return True
    return cond.type == "Degraded" and cond.status == "True" and old.get("reason") != cond.reason


def _one_voice(transitions: list[Transition]) -> list[Transition]:
    """One Event per reason (an invalid spec flips Ready, Progressing and Degraded at once with one
    reason, and three identical Events would be noise), and one Normal Event per status write (Ready
    and Progressing Complete come together when the last replica is ready: one says it). The most
    telling condition speaks; Warnings all speak."""
    by_reason: dict[str, Transition] = {}
    for transition in sorted(transitions, key=lambda t: _EVENT_PRIORITY.index(t.condition.type)):
        by_reason.setdefault(transition.condition.reason, transition)
    ordered = list(by_reason.values())  # most telling first, as they were put in
    normal = next((t for t in ordered if t.event_type == "Normal"), None)
    kept = [t for t in ordered if t.event_type == "Warning" or t is normal]
    return sorted(kept, key=lambda t: CONDITION_TYPES.index(t.condition.type))


def plan_status(obs: Observed, previous: dict[str, Any] | None, now: datetime) -> StatusPlan:
    """The new status (operator-owned keys) and the transitions since ``previous`` (live status)."""
    previous = previous or {}
    before = {c.get("type"): c for c in previous.get("conditions") or [] if isinstance(c, dict)}
    conditions: list[Condition] = []
    transitions: list[Transition] = []
    for cond in sorted(_conditions(obs), key=lambda c: CONDITION_TYPES.index(c.type)):
        old = before.get(cond.type)
        # lastTransitionTime moves only when the status flips (Kubernetes convention).
        stamp: Any = status_time(now)  # or the live RFC 3339 string, which the model parses
        if old is not None and old.get("status") == cond.status and old.get("lastTransitionTime"):
            stamp = str(old["lastTransitionTime"])
        conditions.append(
            Condition(
                type=cond.type,
                status=cond.status,
                reason=cond.reason,
                message=cond.message,
                last_transition_time=stamp,
                observed_generation=obs.generation,
            )
        )
        if _event_worthy(cond, old):
            warn = (cond.type == "Degraded" and cond.status == "True") or (
                cond.type == "Ready" and cond.status == "False" and old is not None
            )
            transitions.append(Transition(cond, "Warning" if warn else "Normal"))
    transitions = _one_voice(transitions)

    dep, desired = obs.deployment, _desired(obs)
    status = InferenceDeploymentStatus(
        replicas=_up_to(dep.replicas, desired) if dep is not None else 0,
        ready_replicas=_up_to(dep.ready_replicas, desired) if dep is not None else 0,
        selector=obs.selector,
        endpoint=obs.endpoint,
        conditions=conditions,
        observed_generation=obs.generation,
        # desiredReplicas is the autoscaler's while autoscaling is on; the operator only mirrors spec.
        desired_replicas=None if obs.autoscaling else obs.desired_replicas,
        measured_cold_start_seconds=(
            round(obs.measured_cold_start_s, 3) if obs.measured_cold_start_s is not None else None
        ),
        model_digest=obs.model_digest,
    )
    # None fields are left out of the patch: the keys another writer owns (the autoscaler's
    # desiredReplicas while autoscaling) and figures not measured yet stay as they are.
    return StatusPlan(status_patch(status), tuple(transitions))
