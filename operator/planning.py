"""What the operator would create for a deployment (``kvfleet plan`` prints it), from its own renderers.

The plan uses the operator's default settings and the replica count the operator would choose
before any autoscaler decision. It shows the ServiceMonitor too; the operator creates that only
where the ServiceMonitor CRD (Prometheus Operator) is installed. Objects have no ownerReferences:
a manifest has no uid yet.
"""

from __future__ import annotations

from typing import Any

from kvfleet.operator.render import Owner, render_children
from kvfleet.operator.replicas import decide_replicas
from kvfleet.operator.settings import OperatorSettings
from kvfleet.resource import InferenceDeployment


def plan_children(deployment: InferenceDeployment, settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    """The objects the operator would apply for ``deployment``, as plain dicts."""
    settings = settings or OperatorSettings()
    desired = deployment.status.desired_replicas if deployment.status is not None else None
    decision = decide_replicas(deployment.spec, desired if deployment.spec.autoscaling_enabled else None)
    owner = Owner(name=deployment.name, namespace=deployment.namespace, uid=deployment.metadata.uid)
    return render_children(owner, deployment.spec, decision.replicas, settings, service_monitor=True)
