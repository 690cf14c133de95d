"""Status is written through the typed status models only (kvfleet/status.py): the operator's plan and
the autoscaler's decision are ``InferenceDeploymentStatus`` models sent as ``status_patch``, each
writer sending only the keys it owns (a merge patch leaves the other's)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet.autoscaler.actuators import KubernetesActuator, ScaleCommand, scale_status
from kvfleet.autoscaler.sources import Target
from kvfleet.kube import KubeClient
from kvfleet.operator.conditions import DeploymentObservation, Observed, plan_status
from kvfleet.operator.pod_health import PodDiagnosis
from kvfleet.status import CONDITION_TYPES, InferenceDeploymentStatus, status_patch
from kvfleet_testkit.kube_emulator import DEPLOYMENTS, INFD, Cluster, RunningOperator, eventually

NS = "default"
AUTOSCALER_KEYS = {"desiredReplicas", "scaleReason", "lastScaleTime"}
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def autoscaled(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"uri": "file:///models/tiny", "servedName": name},
            "engine": {"kind": "reference"},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi", "shmSize": "256Mi"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
        },
    }


def observed(*, autoscaling: bool, pods: PodDiagnosis | None = None) -> Observed:
    deployment = DeploymentObservation(
        spec_replicas=1,
        generation=1,
        observed_generation=1,
        replicas=1,
        ready_replicas=0 if pods else 1,
        updated_replicas=1,
        available_replicas=0 if pods else 1,
        deadline_exceeded=None,
        replica_failure=None,
    )
    return Observed(
        generation=1,
        desired_replicas=1,
        replica_reason="spec.replicas",
        autoscaling=autoscaling,
        deployment=deployment,
        invalid_spec=None,
        apply_error=None,
        endpoint="http://router/v1",
        selector="kvfleet.io/deployment=m",
        measured_cold_start_s=None,
        pods=pods,
    )


async def test_the_status_both_writers_leave_is_the_models_wire_form(
    cluster: Cluster, operator: RunningOperator
) -> None:
    """After the operator's status and the autoscaler's decision, the object's status round-trips
    through the model unchanged: every key is a model field (the model drops unknown keys, so a
    misspelt one would show as a difference) and every value valid; neither write removed the other's."""
    await cluster.create_infd(autoscaled("chat"))
    await eventually(lambda: cluster.get(DEPLOYMENTS, NS, "chat-engine"), what="the engine Deployment")
    await cluster.roll_out(NS, "chat", ready=1)
    at = datetime(2026, 1, 2, 3, 4, 5, 678_000, tzinfo=UTC)
    async with KubeClient.for_server(cluster.url, timeout_s=5) as api:
        await KubernetesActuator(api).apply(Target(NS, "chat", "chat"), ScaleCommand(2, "scale_up: load 40", at))
    # The operator follows the decision (spec.replicas of the engine) and reports again.
    await eventually(
        lambda: (cluster.get(DEPLOYMENTS, NS, "chat-engine") or {}).get("spec", {}).get("replicas") == 2,
        what="the Deployment scaled to the autoscaler's 2",
    )
    await cluster.roll_out(NS, "chat", ready=2)
    status = await eventually(
        lambda: (s := (cluster.get(INFD, NS, "chat") or {}).get("status") or {}).get("readyReplicas") == 2 and s,
        what="readyReplicas 2",
    )
    model = InferenceDeploymentStatus.model_validate(status)
    assert status_patch(model) == status
    assert (model.desired_replicas, model.scale_reason, model.ready_replicas) == (2, "scale_up: load 40", 2)
    assert status["lastScaleTime"] == "2026-01-02T03:04:05Z"  # whole seconds, UTC
    assert [c.type for c in model.conditions] == list(CONDITION_TYPES)
    assert all(c.observed_generation == 1 and c.last_transition_time is not None for c in model.conditions)


def test_each_writer_sends_only_the_keys_it_owns() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678_000, tzinfo=UTC)
    decision = scale_status(ScaleCommand(3, "x" * 5000, at))
    assert set(decision) == AUTOSCALER_KEYS
    assert (decision["lastScaleTime"], len(decision["scaleReason"])) == ("2026-01-02T03:04:05Z", 1024)

    now = datetime(2026, 1, 1, tzinfo=UTC)
    while_autoscaled = plan_status(observed(autoscaling=True), None, now).status
    assert set(while_autoscaled) == {
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "selector",
        "endpoint",
        "conditions",
    }
    assert not AUTOSCALER_KEYS & set(while_autoscaled)
    # Without autoscaling the operator mirrors spec.replicas into desiredReplicas.
    assert plan_status(observed(autoscaling=False), None, now).status["desiredReplicas"] == 1


def test_a_status_the_model_refuses_is_never_sent() -> None:
    """A condition reason the CRD would refuse fails while the plan is built, naming the field."""
    bad = PodDiagnosis(reason="Crash Loop", message="1/1 pods: m-0: back-off")
    with pytest.raises(ValidationError, match=r"Condition\s+reason\s+String should match pattern"):
        plan_status(observed(autoscaling=False, pods=bad), None, datetime(2026, 1, 1, tzinfo=UTC))
