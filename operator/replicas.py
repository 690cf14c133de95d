"""How many engine replicas the Deployment gets: a pure decision with its reason."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.spec import InferenceDeploymentSpec


@dataclass(frozen=True)
class ReplicaDecision:
    replicas: int
    reason: str


def decide_replicas(spec: InferenceDeploymentSpec, status_desired: int | None) -> ReplicaDecision:
    """spec.replicas when autoscaling is off; else the autoscaler's status.desiredReplicas, clamped.

    The clamp matters when the spec's bounds changed after the autoscaler last decided: the spec
    is the user's word and wins until the autoscaler decides again.
    """
    if not spec.autoscaling_enabled or spec.autoscaling is None:
        n = spec.fixed_replicas()
        origin = "spec.replicas" if spec.replicas is not None else "default of 1"
        return ReplicaDecision(n, f"autoscaling is off: {n} from {origin}")
    low, high = spec.autoscaling.min_replicas, spec.autoscaling.max_replicas
    if status_desired is None:
        return ReplicaDecision(low, f"no autoscaler decision yet: minReplicas ({low})")
    if status_desired < low:
        return ReplicaDecision(low, f"autoscaler asked {status_desired}, below minReplicas: {low}")
    if status_desired > high:
        return ReplicaDecision(high, f"autoscaler asked {status_desired}, above maxReplicas: {high}")
    return ReplicaDecision(status_desired, f"autoscaler decision: {status_desired}")
